"""LLaMA-7B with LoRA on one GPU: the largest batch each policy fits, found by compiling and
confirmed by running, with its tokens/s, beside HF transformers + peft.

    python -m benchmarks.llama_fit --json fit.json            # llama-7b, 32 layers, seq 2048
    python -m benchmarks.llama_fit --json fit.json --bases bfloat16 --policies baseline,remat \\
        --seq 1024,4096 --budget-s 500
    python -m benchmarks.llama_fit --smoke --json fit.json    # llama-tiny: any machine (CPU)

The case: ``llama-7b`` at full depth, LoRA r=8 on every linear (query, key, value, out,
gate, up, down), its frozen base kernels stored in ``--bases`` (``base_dtype``: bfloat16,
nf4), bf16 compute, AdamW, next-token loss on random tokens of ``--seq`` length. Rows, in
this order (the most telling first, for a run cut by ``--budget-s``): each base, each policy
(``baseline``, ``lowmem`` (the combined preset), ``lowmembp``, ``remat``), each sequence
length; then the peer at each base and length. Each row:

1. **fit (AOT)**: in a fresh process, the train step compiled with abstract state
   (``train.planner.predict_peak``: nothing materialized or run) at batch 1, 2, 4... until
   the predicted peak passes the memory budget (``--memory-budget``, default ``auto``: the
   device's limit less the planner's 10% margin), then the bracket narrowed to one
   (``benchmarks.fit_search``; the next batch read off the line through two peaks), batch
   capped at ``--cap``. Compiles and their seconds are recorded.
2. **confirm**: a fresh process per try (the allocator's peak is process-lifetime) holds
   the model in storage form (no fp32 copy of 28 GB is ever made: a one-layer model is built
   on the host CPU, its kernels stored in the base dtype there, and each of its leaves put
   on the device and broadcast to every layer: all layers the same weights, which changes
   neither memory nor speed), compiles the step, runs ``--warmup`` + ``--steps`` steps at
   the AOT batch and records ``peak_bytes_in_use``, the median step time (host clock
   around ``block_until_ready``) and tokens/s. Out of memory: the batch steps down (1, 2,
   4... below, then bisection) to the largest that runs. Prediction error = (predicted -
   real) / real, the prediction being the peak of the very executable that ran.
3. **peer**: ``benchmarks/peers.py --case llama-lora --base-dtype B --find-max-batch``: HF
   ``LlamaForCausalLM`` of the same widths and depth with its weights in the base dtype,
   peft LoRA on the same seven linears, its largest batch found by running (out of memory
   caught), then timed. nf4 needs bitsandbytes: without it the row says it is missing.

``--target h100`` (:mod:`lowmem_jax.gpu_target`): step 1 only, compiled for that GPU on any
machine (XLA:GPU's executable, no device): the largest batch by XLA:GPU's compiled memory,
to be confirmed by running on the GPU itself. ``--aot-json FILE`` (that run's JSON, e.g.
``docs/h100_compiled/llama7b_fit.json``) does that on the GPU: the rows the file holds
skip step 1 and go straight to 2 at its batch (a search on the device compiled 4-7 times
a row, 22-59 s on the H100 of 2026-11-25). The batch is then the compile target's,
confirmed, not searched again with the device's own compiler; the prediction error is
still that of the executable that ran.

The JSON is rewritten after every row (a cut run keeps the finished ones); rows left out
by ``--budget-s`` (no new row starts after it) are listed under ``not_run``. The child
processes get ``XLA_PYTHON_CLIENT_MEM_FRACTION=--mem-fraction`` (default 0.95: the peer's
PyTorch allocator may use the whole GPU); this process never touches the device.
``--smoke``: llama-tiny (2 layers), sequence 32, a budget of 1.25 MiB, cap 8, baseline on
an nf4 base and its peer: a check of the machinery, on a CPU in well under a minute. CPU has no
``peak_bytes_in_use``: the confirmed rows' real peak is None there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.fit_search import largest_at_most, largest_fitting
from lowmem_jax import cli_checks
from lowmem_jax.gpu_check import LLAMA_LORA_TARGETS
from lowmem_jax.memory import format_table, split_policies, write_json
from lowmem_jax.policy import MemoryPolicy
from train.config import TrainConfig, parse_budget

ROOT = Path(__file__).resolve().parents[1]
PEERS_SCRIPT = ROOT / "benchmarks" / "peers.py"
DEFAULT_POLICIES = ("baseline", "lowmem", "lowmembp", "remat")
DEFAULT_BASES = ("bfloat16", "nf4")
PEER_BASES = ("float32", "bfloat16", "nf4")  # what benchmarks/peers.py can build
# A row's child process (search, confirm run, peer) killed after this many seconds: on a
# device lent for minutes a hung child costs this, not the call (a 7B search compiled 4-9
# times in 32-67 s on the H200 of 11-27; the peer's batch search runs many steps)
CHILD_TIMEOUT_S = 420.0
# --smoke: tiny shapes whose peaks (about 1-3 MiB on a CPU) cross the budget within a few
# examples: baseline fits batch 1 (2 compiles; ~25 s on 2 cores with the run and the peer's
# missing bitsandbytes); --policies lowmem fits 2 (the bracket [2, 4] narrowed: 4 compiles)
SMOKE = {"model": "llama-tiny", "layers": 2, "seq": "32", "memory_budget": "1.25MiB", "cap": 8,
         "warmup": 1, "steps": 2, "policies": "baseline", "bases": "nf4"}
FULL = {"model": "llama-7b", "layers": None, "seq": "2048", "memory_budget": "auto",
        "cap": 256, "warmup": 1, "steps": 3, "policies": ",".join(DEFAULT_POLICIES),
        "bases": ",".join(DEFAULT_BASES)}


# ----------------------------------------------------------------------------- the case
def row_config(spec: dict, batch: int = 1) -> TrainConfig:
  """The train config of a row (``spec``: model, layers, seq, policy, base_dtype) at
  ``batch``."""
  overrides = {} if spec.get("layers") is None else {"num_layers": spec["layers"]}
  return TrainConfig(name="llama-fit", task="lm", model=spec["model"],
                     model_overrides=overrides, policy=spec.get("policy", "baseline"),
                     dtype="bfloat16", max_len=spec["seq"], batch_size=batch,
                     trainable="lora", lora_rank=8, lora_targets=LLAMA_LORA_TARGETS,
                     base_dtype=spec["base_dtype"], eval_every=0, compare_baseline=False)


def batch_shapes(cfg: TrainConfig) -> dict:
  """The train step's batch (tokens, targets, loss mask) at ``cfg.batch_size`` as
  ShapeDtypeStructs."""
  import jax
  from train.bench import synthetic_dataset
  one = synthetic_dataset(cfg, 1).arrays
  return {k: jax.ShapeDtypeStruct((cfg.batch_size,) + a.shape[1:], a.dtype)
          for k, a in one.items()}


def resident_trainer(abstract):
  """``abstract`` (``train.planner.abstract_trainer(cfg)``: its state ShapeDtypeStructs)
  with its state on the device, the frozen kernels in storage form, and no fp32 copy of
  the model made anywhere: the state of a one-layer model is built on the host CPU (its
  kernels stored in ``base_dtype`` there), and each leaf is put on the device and
  broadcast along the layer axis to the full depth (every layer the same weights: memory
  and speed do not depend on them)."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  from train.model import model_config
  from train.trainer import Trainer

  cfg = abstract.cfg
  layers = model_config(cfg).num_layers
  one = cfg.replace(model_overrides={**cfg.model_overrides, "num_layers": 1})
  try:
    host = jax.devices("cpu")[0]
  except RuntimeError:  # JAX_PLATFORMS without cpu: one layer on the device, then
    host = jax.devices()[0]
  with jax.default_device(host):
    small = Trainer.create(one).state
  device = jax.devices()[0]

  def fill(want, leaf):
    if leaf.dtype != want.dtype:
      raise ValueError(f"resident_trainer: a leaf is {leaf.dtype}, the step expects "
                       f"{want.dtype}")
    leaf = jax.device_put(leaf, device)
    if leaf.shape == want.shape:
      return leaf
    if leaf.shape[:1] == (1,) and want.shape == (layers,) + leaf.shape[1:]:
      return jnp.broadcast_to(leaf, want.shape)  # a new buffer; the one layer is dropped
    raise ValueError(f"resident_trainer: a leaf of shape {leaf.shape} does not stack to "
                     f"{want.shape} ({layers} layers)")
  state = jax.tree.map(fill, abstract.state, small)
  return dataclasses.replace(abstract, state=state)


def _device_info() -> dict:
  import jax

  from lowmem_jax import gpu_target
  from train.bench import _device_info as info
  if gpu_target.active() is not None:
    return {**info(), "bytes_limit": gpu_target.bytes_limit()}
  stats = jax.devices()[0].memory_stats() or {}
  return {**info(), "bytes_limit": stats.get("bytes_limit")}


def out_of_memory(error: BaseException) -> bool:
  """Whether ``error`` is XLA running out of device memory."""
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


# ----------------------------------------------------------------------------- children
def search_child(spec: dict) -> dict:
  """Step 1 of a row (in its own process): the largest batch whose compiled peak fits; for
  ``spec["target"]``'s GPU when set (:mod:`lowmem_jax.gpu_target`)."""
  from lowmem_jax import gpu_target

  with gpu_target.compiling_for(spec.get("target")):
    return _search(spec)


def _search(spec: dict) -> dict:
  from train.planner import fmt_bytes, predict_peak, resolve_budget

  budget = resolve_budget(spec["memory_budget"])
  seconds = []

  def peak_of(batch: int) -> int:
    cfg = row_config(spec, batch)
    start = time.perf_counter()
    peak = predict_peak(cfg, batch_shapes(cfg))
    seconds.append(time.perf_counter() - start)
    print(f"  batch {batch}: predicted peak {fmt_bytes(peak)} ({seconds[-1]:.1f} s)",
          flush=True)
    return peak
  found = largest_fitting(peak_of, budget, spec["cap"])
  return {"max_batch": found.best, "predicted_peak": found.peak, "capped": found.capped,
          "compiles": found.trials, "compile_s": sum(seconds), "tried": found.tried,
          "budget_bytes": budget, **_device_info()}


def confirm_child(spec: dict, batch: int) -> dict:
  """Step 2 (in its own process): ``warmup`` + ``steps`` real steps at ``batch``: the
  allocator's peak, step times, and the peak predicted for this very executable."""
  import jax
  from lowmem_jax.memory import compiled_memory
  from train.batches import Batches
  from train.bench import _Runner, synthetic_dataset
  from train.planner import PLAN_COMPILER_OPTIONS, abstract_trainer

  cfg = row_config(spec, batch)
  result = {"batch": batch, **_device_info()}
  try:
    abstract = abstract_trainer(cfg)
    trainer = resident_trainer(abstract)
    runner = _Runner(trainer, Batches(synthetic_dataset(cfg, 2 * batch), batch,
                                      seed=cfg.seed))
    # the search's very executable (predict_peak's: abstract state, the planner's compiler
    # options), from the compilation cache where one is on
    options = PLAN_COMPILER_OPTIONS.get(jax.default_backend(), {})
    lowered = abstract.lower(batch_shapes(cfg))
    compiled = lowered.compile(compiler_options=options)
    predicted = compiled_memory(compiled).total
    trainer.train_step = compiled  # the steps run the very executable predicted
    times = []
    for _ in range(spec["warmup"] + spec["steps"]):
      start = time.perf_counter()
      jax.block_until_ready(runner())
      times.append(time.perf_counter() - start)
  except Exception as e:  # noqa: BLE001  (only out-of-memory is an answer; the rest raises)
    if not out_of_memory(e):
      raise
    return {**result, "ok": False, "error": str(e).strip().splitlines()[0][:500]}
  stats = jax.devices()[0].memory_stats() or {}
  real = stats.get("peak_bytes_in_use")
  step_s = statistics.median(times[spec["warmup"]:])
  loss = float(runner.metrics["loss"])
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.state))
  return {**result, "ok": True, "predicted_peak": predicted, "real_peak": real,
          "state_bytes": state_bytes,
          "error_pct": None if real is None else 100.0 * (predicted - real) / real,
          "step_s": step_s, "step_s_all": times, "tokens_per_step": batch * spec["seq"],
          "tokens_per_s": batch * spec["seq"] / step_s, "final_loss": loss,
          "finite": trainer.first_bad_step() is None and math.isfinite(loss)}


def _child_env(mem_fraction: float) -> dict:
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=str(mem_fraction))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  return env


def _run_timed(cmd: list[str], spec: dict, **kw):
  """``subprocess.run(cmd)`` killed after the row's ``child_timeout`` seconds (None: no
  limit): a child that hangs costs that, not the rest of a device's lease; a
  CompletedProcess with exit code None and a stderr saying so when it was killed."""
  timeout = spec.get("child_timeout")
  try:
    return subprocess.run(cmd, cwd=ROOT, text=True, timeout=timeout, **kw)
  except subprocess.TimeoutExpired:
    return subprocess.CompletedProcess(cmd, None, None, f"killed after {timeout:g} s "
                                       "(--child-timeout)")


def run_child(kind: str, spec: dict, mem_fraction: float, batch: int = 0) -> dict:
  """Runs a row's step in a fresh process: its result, or ``{"error": ...}`` when the
  process failed or timed out (its stderr's last lines)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "child.json"
    cmd = [sys.executable, "-m", "benchmarks.llama_fit", "--child", kind, "--spec",
           json.dumps(spec), "--batch", str(batch), "--out", str(out)]
    proc = _run_timed(cmd, spec, env=_child_env(mem_fraction), stdout=None,
                      stderr=subprocess.PIPE)
    if proc.returncode != 0 or not out.exists():
      tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
      return {"error": f"{kind} process exit {proc.returncode}: {tail}"}
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- rows
def our_row(spec: dict, mem_fraction: float) -> dict:
  """A policy's row: the AOT fit, then runs at it (stepping down on out of memory)."""
  row = {"kind": "ours", "policy": spec["policy"], "base_dtype": spec["base_dtype"],
         "seq": spec["seq"]}
  found = spec.get("aot") or run_child("search", spec, mem_fraction)
  row["search"] = found
  if "error" in found:
    return {**row, "error": found["error"]}
  row.update(max_batch_aot=found["max_batch"],
             tokens_per_step_aot=found["max_batch"] * spec["seq"],
             predicted_peak_aot=found["predicted_peak"], capped=found["capped"],
             compiles=found["compiles"], compile_s=found["compile_s"],
             budget_bytes=found["budget_bytes"],
             device_kind=found["device_kind"], backend=found["backend"])
  if "aot_from" in found:
    row["aot_from"] = found["aot_from"]
  if found["max_batch"] == 0:
    return {**row, "max_batch_run": 0,
            "note": f"batch 1 is predicted at {found['tried'][0][1]} bytes, over the budget"}
  if spec.get("target"):
    return {**row, "compile_target": spec["target"],
            "note": "compiled for a GPU not attached (--target): nothing run"}
  runs: dict[int, dict] = {}

  def runs_at(batch: int) -> bool:
    runs[batch] = run_child("confirm", spec, mem_fraction, batch)
    if "error" in runs[batch] and "ok" not in runs[batch]:
      raise RuntimeError(runs[batch]["error"])
    return runs[batch]["ok"]
  try:
    best, tried = largest_at_most(runs_at, found["max_batch"])
  except RuntimeError as e:
    return {**row, "error": str(e), "confirm_runs": list(runs.values())}
  row.update(max_batch_run=best, confirm_tries=[list(t) for t in tried],
             confirm_runs=list(runs.values()))
  if best:
    run = runs[best]
    row.update(device_kind=run["device_kind"], backend=run["backend"])  # what ran it
    compiled_for = row.get("aot_from", {}).get("device_kind")
    if compiled_for and compiled_for != run["device_kind"]:
      row["note"] = (f"the batch was compiled for {compiled_for} and ran on "
                     f"{run['device_kind']}: not searched for this device")
    row.update({k: run[k] for k in ("predicted_peak", "real_peak", "error_pct", "state_bytes",
                                    "step_s", "tokens_per_step", "tokens_per_s",
                                    "final_loss", "finite")})
  return row


def peer_row(spec: dict, cap: int) -> dict:
  """HF Llama + peft at the row's base dtype and length: its largest batch by running."""
  from train.bench_peers import peer_args

  row = {"kind": "peer", "policy": "torch+peft", "base_dtype": spec["base_dtype"],
         "seq": spec["seq"]}
  if spec["base_dtype"] not in PEER_BASES:
    return {**row, "missing": f"no {spec['base_dtype']} base in benchmarks/peers.py"}
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "peer.json"
    cmd = [sys.executable, str(PEERS_SCRIPT), *peer_args(row_config(spec)),
           "--base-dtype", spec["base_dtype"], "--find-max-batch", "--max-batch", str(cap),
           "--warmup", str(spec["warmup"]), "--steps", str(spec["steps"]),
           "--json", str(out)]
    proc = _run_timed(cmd, spec, env=_child_env(1.0), stdout=subprocess.DEVNULL,
                      stderr=subprocess.PIPE)
    result = json.loads(out.read_text()) if out.exists() else {}
  if "missing" in result:
    return {**row, "missing": result["missing"]}
  if proc.returncode != 0 or not result:
    tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
    return {**row, "error": f"peer exit {proc.returncode}: {tail}"}
  search = result["find_max_batch"]
  row.update(max_batch_run=search["max_batch"], capped=search["capped"], peer=result,
             device_kind=result["device_name"])
  if search["max_batch"]:
    row.update(real_peak=result["peak_bytes"], step_s=result["step_ms"] / 1e3,
               tokens_per_step=result["items_per_step"], tokens_per_s=result["throughput"],
               final_loss=result["final_loss"], finite=result["finite"])
  return row


def add_peer_ratios(rows: list[dict]) -> None:
  """Each of our rows' tokens/step and tokens/s over the peer's at its base and length."""
  peers = {(r["base_dtype"], r["seq"]): r for r in rows if r["kind"] == "peer"}
  for r in rows:
    peer = peers.get((r["base_dtype"], r["seq"]))
    if r["kind"] != "ours" or not peer:
      continue
    for key in ("tokens_per_step", "tokens_per_s"):
      if r.get(key) and peer.get(key):
        r[f"{key}_vs_peer"] = r[key] / peer[key]


def _bytes(n) -> str:
  from train.planner import fmt_bytes
  return "-" if n is None else fmt_bytes(n)


def _num(x, spec: str) -> str:
  return "-" if x is None else format(x, spec)


def _run_cell(row: dict) -> str:
  """The run column: the batch that ran (``+``: the cap), or why there is none."""
  if "error" in row:
    return "failed"
  if "missing" in row:
    return f"missing: {row['missing']}"
  if row["kind"] == "peer" and row.get("capped"):
    return f"{row['max_batch_run']}+"
  if row.get("compile_target"):
    return f"not run ({row['compile_target']} compile)"
  return _num(row.get("max_batch_run"), "d")


def summary(row: dict) -> str:
  """One line on a finished row."""
  if "error" in row:
    return "failed: " + (row["error"].strip().splitlines() or ["?"])[-1]
  if "missing" in row:
    return f"missing: {row['missing']}"
  aot = f"{row['max_batch_aot']} by compiling, " if "max_batch_aot" in row else ""
  if "aot_from" in row:
    aot = f"{row['max_batch_aot']} by compiling ({row['aot_from']['file']}), "
  if row.get("compile_target"):
    return (f"batch {row['max_batch_aot']} by compiling for {row['compile_target']} "
            f"(predicted peak {_bytes(row['predicted_peak_aot'])}), not run")
  note = f" ({row['note']})" if row.get("note") else ""
  return (f"batch {aot}{row.get('max_batch_run')} by running, "
          f"{_num(row.get('tokens_per_s'), '.0f')} tokens/s{note}")


def table(result: dict) -> str:
  """The rows: fit (AOT) and run, peaks, prediction error, speed, against the peer."""
  rows = []
  for r in result["rows"]:
    aot = r.get("max_batch_aot")
    rows.append([r["policy"], r["base_dtype"], r["seq"],
                 "-" if aot is None else f"{aot}{'+' if r.get('capped') else ''}",
                 _run_cell(r), _num(r.get("tokens_per_step", r.get("tokens_per_step_aot")), "d"),
                 _bytes(r.get("predicted_peak", r.get("predicted_peak_aot"))),
                 _bytes(r.get("real_peak")),
                 _num(r.get("error_pct"), "+.1f"), _num(r.get("tokens_per_s"), ".0f"),
                 _num(r.get("tokens_per_step_vs_peer"), ".2f"),
                 _num(r.get("tokens_per_s_vs_peer"), ".2f")])
  return format_table(("policy", "base", "seq", "max batch AOT", "max batch run",
                       "tokens/step", "predicted peak", "real peak", "error %", "tokens/s",
                       "tok/step vs peer", "tok/s vs peer"), rows)


def row_specs(args) -> list[dict]:
  """Every row, in run order: ours (base, policy, length), then the peer's (base, length)."""
  common = {"model": args.model, "layers": args.layers, "memory_budget": args.memory_budget,
            "cap": args.cap, "warmup": args.warmup, "steps": args.steps,
            "child_timeout": args.child_timeout or None}
  if args.target:
    common["target"] = args.target
  specs = [{**common, "kind": "ours", "base_dtype": b, "policy": p, "seq": s}
           for b in args.bases for p in args.policies for s in args.seq]
  for spec in specs:
    aot = (args.aot or {}).get((spec["base_dtype"], spec["policy"], spec["seq"]))
    if aot is not None:
      spec["aot"] = aot
  if args.peer and not args.target:
    specs += [{**common, "kind": "peer", "base_dtype": b, "seq": s}
              for b in args.peer_bases or args.bases for s in args.seq]
  return specs


def _label(spec: dict) -> str:
  who = spec.get("policy") or "torch+peft"
  return f"{who} / {spec['base_dtype']} / seq {spec['seq']}"


def read_aot(path: str, model: str, layers: int | None) -> dict:
  """``(base_dtype, policy, seq) -> fit`` from a ``--target`` run's JSON (``--aot-json``):
  each of its rows with a largest batch, as :func:`search_child` would have found it.
  ValueError naming the file when it is missing, not such a JSON, or of another model."""
  try:
    result = json.loads(Path(path).read_text())
  except OSError as e:
    raise ValueError(f"--aot-json {path}: {e.strerror or e}") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"--aot-json {path}: not JSON ({e.msg}, line {e.lineno})") from None
  if not isinstance(result, dict) or result.get("benchmark") != "llama_fit" or \
      not result.get("compile_target"):
    raise ValueError(f"--aot-json {path}: not the JSON of a "
                     "'python -m benchmarks.llama_fit --target GPU' run")
  if (result.get("model"), result.get("layers")) != (model, layers):
    raise ValueError(f"--aot-json {path}: its rows are {result.get('model')} with layers="
                     f"{result.get('layers')}, this run is {model} with layers={layers}")
  fits = {}
  for row in result.get("rows", []):
    if row.get("kind") != "ours" or not row.get("max_batch_aot"):
      continue
    search = row.get("search", {})
    fits[(row["base_dtype"], row["policy"], row["seq"])] = {
        "max_batch": row["max_batch_aot"], "predicted_peak": row["predicted_peak_aot"],
        "capped": row["capped"], "compiles": 0, "compile_s": 0.0,
        "budget_bytes": row["budget_bytes"], "tried": search.get("tried", []),
        "device_kind": None, "backend": None,
        "aot_from": {"file": str(path), "compile_target": result["compile_target"],
                     "jax_version": search.get("jax_version"),
                     "device_kind": row.get("device_kind")}}
  return fits


# ----------------------------------------------------------------------------- CLI
def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.llama_fit", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--json", metavar="FILE", help="the rows as JSON (rewritten after each)")
  ap.add_argument("--smoke", action="store_true",
                  help=f"tiny defaults ({', '.join(f'{k}={v}' for k, v in SMOKE.items())})")
  ap.add_argument("--model", help=f"a llama preset (default {FULL['model']})")
  ap.add_argument("--layers", type=int, help="number of layers (default: the preset's)")
  ap.add_argument("--policies", help=f"comma-separated (default {FULL['policies']}); "
                  "none: the peer's rows only")
  ap.add_argument("--bases", help="frozen base dtypes (TrainConfig.base_dtype), "
                  f"comma-separated (default {FULL['bases']})")
  ap.add_argument("--seq", help=f"sequence lengths, comma-separated (default {FULL['seq']})")
  ap.add_argument("--memory-budget", help="the fit's budget: bytes, a size ('70GiB') or "
                  "auto: the device's limit less 10%% (default auto)")
  ap.add_argument("--cap", type=int, help=f"largest batch tried (default {FULL['cap']})")
  ap.add_argument("--warmup", type=int, help="untimed steps per confirm run (default 1)")
  ap.add_argument("--steps", type=int, help="timed steps per confirm run (default 3)")
  ap.add_argument("--budget-s", type=float, default=math.inf,
                  help="no new row starts after this many seconds (default: none)")
  ap.add_argument("--child-timeout", type=float, default=CHILD_TIMEOUT_S, metavar="S",
                  help="kill a row's search, run or peer process after S seconds, its row "
                       f"an error (default {CHILD_TIMEOUT_S:.0f}; 0: no limit)")
  ap.add_argument("--no-peer", dest="peer", action="store_false",
                  help="leave out the HF transformers + peft rows")
  ap.add_argument("--peer-bases", help="the peer rows' base dtypes, comma-separated "
                  f"(default: --bases; the peer builds {', '.join(PEER_BASES)}; nf4 needs "
                  "bitsandbytes)")
  ap.add_argument("--target", metavar="GPU",
                  help="only the fit (AOT), compiled for this GPU instead of the local "
                       "device (lowmem_jax.gpu_target: h100; no GPU needed): no run, no "
                       "peer; 'auto' budget: its memory x --mem-fraction less 10%%")
  ap.add_argument("--aot-json", metavar="FILE",
                  help="each row's fit from this JSON of an earlier --target run (e.g. "
                       "docs/h100_compiled/llama7b_fit.json) instead of a search here: its "
                       "rows only confirm that batch by running (stepping down on out of "
                       "memory); rows it lacks search as usual")
  ap.add_argument("--mem-fraction", type=float, default=0.95,
                  help="XLA_PYTHON_CLIENT_MEM_FRACTION of the child processes "
                       "(default %(default)s)")
  ap.add_argument("--child", choices=("search", "confirm"), help=argparse.SUPPRESS)
  ap.add_argument("--spec", help=argparse.SUPPRESS)
  ap.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
  ap.add_argument("--out", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    return args
  cli_checks.output_file(ap, args, "--json")
  defaults = SMOKE if args.smoke else FULL
  for key, value in defaults.items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  try:
    if args.aot_json and args.target:
      raise ValueError("--aot-json gives a --target run's fit to confirm by running; it "
                       "does not go with --target")
    # "none": the peer's rows only (ours ran in an earlier call)
    args.policies = ([] if args.policies.strip() == "none"
                     else split_policies(args.policies))
    if not args.policies and (not args.peer or args.target):
      raise ValueError("--policies none leaves only the peer's rows, which --no-peer and "
                       "--target leave out: nothing to run")
    for p in args.policies:
      MemoryPolicy.parse(p)
    args.bases = [b.strip() for b in args.bases.split(",") if b.strip()]
    if args.peer_bases is not None:
      args.peer_bases = [b.strip() for b in args.peer_bases.split(",") if b.strip()]
      unknown = [b for b in args.peer_bases if b not in PEER_BASES]
      if unknown or not args.peer_bases:
        raise ValueError(f"--peer-bases {','.join(unknown) or '(none)'}: the peer builds "
                         f"{', '.join(PEER_BASES)}")
    args.seq = [int(s) for s in str(args.seq).split(",") if s.strip()]
    if not args.bases or not args.seq or min(args.seq) < 1:
      raise ValueError(f"--bases and --seq need at least one value each, lengths >= 1; got "
                       f"{args.bases} and {args.seq}")
    parse_budget(args.memory_budget)
    if args.target:  # an unknown name, or no CUDA plugin: one line, before any row
      from lowmem_jax.gpu_target import device
      device(args.target)
    from train.model import model_config
    for base in args.bases:  # TrainConfig names a bad base dtype
      cfg = row_config({"model": args.model, "layers": args.layers, "seq": args.seq[0],
                        "base_dtype": base})
    model_config(cfg)  # and a bad model or layer count
    args.aot = read_aot(args.aot_json, args.model, args.layers) if args.aot_json else None
  except (ValueError, RuntimeError) as e:  # RuntimeError: gpu_target.TargetUnavailable
    ap.error(str(e))
  for name in ("cap", "steps"):
    if getattr(args, name) < 1:
      ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if args.warmup < 0 or not 0 < args.mem_fraction <= 1:
    ap.error(f"--warmup must be >= 0 and --mem-fraction in (0, 1], got {args.warmup} and "
             f"{args.mem_fraction}")
  return args


def main(argv: Sequence[str] | None = None) -> dict | None:
  args = parse_args(argv)
  if args.child:  # a row's step, in its own process
    spec = json.loads(args.spec)
    out = search_child(spec) if args.child == "search" else confirm_child(spec, args.batch)
    Path(args.out).write_text(json.dumps(out))
    return None

  specs = row_specs(args)
  result = {"benchmark": "llama_fit", "model": args.model,
            "layers": args.layers, "lora": {"rank": 8, "targets": LLAMA_LORA_TARGETS},
            "dtype": "bfloat16", "memory_budget": args.memory_budget, "cap": args.cap,
            "mem_fraction": args.mem_fraction, "warmup_steps": args.warmup,
            "timed_steps": args.steps, "smoke": args.smoke, "compile_target": args.target,
            "budget_s": None if math.isinf(args.budget_s) else args.budget_s,
            "rows": [], "not_run": []}
  start = time.perf_counter()
  for spec in specs:
    if time.perf_counter() - start > args.budget_s:
      result["not_run"].append(_label(spec))
      continue
    print(f"[llama_fit] {_label(spec)}", flush=True)
    t0 = time.perf_counter()
    row = (our_row(spec, args.mem_fraction) if spec["kind"] == "ours" else
           peer_row(spec, args.cap))
    row["seconds"] = time.perf_counter() - t0
    result["rows"].append(row)
    result.setdefault("device_kind", row.get("device_kind"))
    add_peer_ratios(result["rows"])
    write_json(args.json, result, announce=False)
    print(f"[llama_fit] {_label(spec)}: {summary(row)} ({row['seconds']:.0f} s)", flush=True)
  wall = time.perf_counter() - start
  result["wall_s"] = wall
  write_json(args.json, result, announce=False)
  device = result.get("device_kind") or "unknown device"
  print(f"\n{args.model}" + (f" ({args.layers} layers)" if args.layers else "")
        + f", LoRA r=8 on {LLAMA_LORA_TARGETS}, bf16 compute; {device}; memory budget "
        f"{args.memory_budget}; {wall:.0f} s")
  print(table(result))
  if result["not_run"]:
    print(f"not run (--budget-s {args.budget_s:.0f}): {'; '.join(result['not_run'])}")
  if args.json:
    print(f"wrote {args.json}")
  return result


def exit_status(result: dict | None) -> int:
  """1 where a row failed (a table of "failed" rows exited 0, and gpu_check's stage read
  passed), else 0; a missing peer package is no failure of ours."""
  failed = [_label(r) for r in (result or {}).get("rows", []) if "error" in r]
  if failed:
    print(f"failed: {'; '.join(failed)}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(exit_status(main()))
