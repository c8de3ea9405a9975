"""One command that checks the project on a GPU and writes one report.

    python -m lowmem_jax.gpu_check --out DIR               # DIR/report.json + DIR/report.md
    python -m lowmem_jax.gpu_check --out DIR --docs        # also docs/gpu/<device>-<date>.*
    python -m lowmem_jax.gpu_check --smoke --out DIR       # tiny shapes, one test function
    python -m lowmem_jax.gpu_check --stages env,kernel-bench --out DIR
    python -m lowmem_jax.gpu_check --call 2 --out DIR2 --docs  # the second call's stages
    python -m lowmem_jax.gpu_check --stages env,tests --budget 540 --shard 1/3  # 1/3 suite

Each stage is a subprocess with its own timeout, run one after another (they share the
GPU): ``env`` (device, jax/jaxlib/CUDA/cuDNN versions), ``train`` (the README's ``python -m
train``), ``bench-vit`` and ``bench-llama`` (``train.bench`` on ViT-B/16 at 224 px, batch
64, LoRA r=8 on query/value; and 4 layers of LLaMA-7B widths, batch 4 x 1024, LoRA r=8 on
all 7 linears, WTA-CRS among its policies; random data; with ``--peers``: timm / HF Llama +
peft on the same shapes, with and without checkpointing, which on a GPU implies ``--peak``;
and ``--profile``: each run's device time by kernel kind and source line, ours and theirs),
``kernel-bench``, ``attention-bench``, ``bench-remat`` (ViT-B LoRA as in ``bench-vit``:
``lowmem``, ``mesa8`` and ``wta-crs`` against JAX's remat policies and offload,
``--peak``), ``reversible-depth`` (``benchmarks.reversible_depth``: RevViT-B peak at 12 and
24 layers under baseline, reversible and pareprop, a fresh process each, and PaReprop's
speed in CUDA graphs' concurrent regions (vanilla's too, its control), on a second stream
and with XLA's latency hiding scheduler, in that order, as the stage's time allows) and
``tests`` (the suite in pytest-xdist workers, ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, GEMM
autotuning off, counted from its JUnit XML). A stage that fails or times out is recorded
and the next one runs; a bench keeps the policies that ran when one fails, and its peers'
and peaks' figures when its timed run is cut. All stages share a budget (``--budget``,
default 540 s on a GPU: one call within a command's 10 minutes, and with the machine's
start within a lease's 15 minutes of device time): a stage's timeout is its own, cut so
the stages after it keep their expected times; ``tests`` runs last and gets what is left.
All stages share one persistent compilation cache (``DIR/xla-cache``): a bench's timed
process loads what its ``--peak`` subprocesses compiled. One call runs
:data:`DEFAULT_STAGES`; ``bench-remat``, ``kernel-bench``, ``attention-bench`` and
``reversible-depth`` make the second call (:data:`SECOND_CALL`, ``--call 2``): together
they would not fit in one. ``llama-fit`` (``benchmarks.llama_fit``: LLaMA-7B LoRA on bf16
and nf4 bases, the largest batch per policy found by compiling and confirmed by running,
beside HF + peft) is a third call of its own (:data:`THIRD_CALL`: ``--call 3``), with
``train-plan`` after it as time allows (``python -m train`` choosing its plan for ViT-B/16
LoRA batch 64 under ``memory_budget=2GiB``, 3 steps, the predicted peak's error against
``peak_bytes_in_use`` after step 1). On the GPU machines, which hold no ``.git``, pass
``--commit <hash>`` to record the commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path

from lowmem_jax import cli_checks

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("env", "train", "bench-vit", "bench-llama", "bench-remat", "kernel-bench",
          "attention-bench", "reversible-depth", "llama-fit", "train-plan", "tests")
# what one call runs (GPU_BUDGET_S); the rest is a second call (SECOND_CALL) and a
# third (THIRD_CALL: LLaMA-7B's largest batches, then the planner in the train loop, as
# the call's time allows)
SECOND_CALL = ("env", "bench-remat", "reversible-depth", "kernel-bench", "attention-bench")
THIRD_CALL = ("env", "llama-fit", "train-plan")
DEFAULT_STAGES = tuple(s for s in STAGES if s not in SECOND_CALL[1:] + THIRD_CALL[1:])
CALLS = {1: DEFAULT_STAGES, 2: SECOND_CALL, 3: THIRD_CALL}  # --call N
LLAMA_LORA_TARGETS = "query,key,value,out,gate,up,down"
TESTS_XLA_FLAGS = "--xla_gpu_autotune_level=0"  # the tests stage: no GEMM autotuning
PEERS_S = (120, 55)  # --peers (+ the --peak it implies on a GPU): (timeout, reserve) per bench
XLA_CACHE = "xla-cache"  # under --out: the stages' shared persistent compilation cache
SLOWEST = 15  # the tests stage lists its slowest tests (where the GPU suite's time goes)
KILL_GRACE_S = 20  # after SIGINT at a timeout (pytest then writes its JUnit XML)
# all stages of one call: with the kill grace and the report it stays inside one command's
# 10 minutes, and with the machine's start (1-2 minutes) inside a lease's 15 minutes of
# device time, leaving a few minutes for a short second call on the warm machine
GPU_BUDGET_S = 540
SMOKE_BUDGET_S = 1800  # a loaded CPU: slow, and --smoke only checks the check
SMOKE_TIMEOUT_FACTOR = 3
# llama-fit: (stage timeout, --budget-s: no new row after it). Estimate, unmeasured: on an
# H100 a row is ~2-3 minutes: a fresh process compiling the 32-layer step 4-8 times (~15-30
# s each, GPU autotuning included), then a fresh process that builds the state (~15 s), compiles
# and runs 1 + 3 steps at ~10k tokens/s (baseline ~12k tokens/step: ~5 s; remat ~120k
# tokens/step: ~60 s); the peer ~1-2 minutes. So one call gets the bf16 rows of baseline,
# lowmem and perhaps lowmembp; the rest (remat, nf4, the peer) need more calls:
# `python -m benchmarks.llama_fit --policies ... --bases ... --json F` (see its docstring).
LLAMA_FIT_S = (400, 200)
# train-plan: python -m train choosing a plan for ViT-B/16 LoRA batch 64 under a 2 GiB
# budget, the H100's bench peaks being baseline 3348, lowmembp 2314, lowmem 1562 MiB
# (75013e6): the fastest plan that fits is a real choice, then 3 steps and the
# prediction's error against peak_bytes_in_use after step 1
PLAN_BUDGET = "2GiB"


@dataclasses.dataclass
class Stage:
  """A subprocess to run: ``cmd`` None means the tool is missing (recorded as such).
  ``timeout_s`` is its own limit; ``reserve_s`` what the budget keeps for it (its
  expected time on an H100, an estimate)."""
  name: str
  cmd: list[str] | None
  timeout_s: float
  reserve_s: float = 0.0
  json_file: str | None = None
  junit_file: str | None = None
  env: dict = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- stages
# the lean exact baseline, LowMemoryBP, the combined preset, the preset under timm + peft
# + checkpointing's peak (issue 14) and full remat, beside the peers; the baseline and
# that preset also with their layers unrolled (lowmem_jax.layers: no residual copied in
# and out of a scan's stacks; compiled for an H100, the baseline launches 441 fewer
# kernels and copies 7.9 GiB less per step). plain (39.9 ms on 2026-11-25) made room.
BENCH_POLICIES = ("baseline", "baseline+layers=unrolled", "lowmembp", "lowmem",
                  "lowmem+qkv=recompute", "lowmem+qkv=recompute+layers=unrolled", "remat")
# LLaMA widths: WTA-CRS under LoRA (ViT-B's WTA-CRS row is bench-remat's); the preset
# that met issue 14's ViT-B target (H200, 2026-11-27); then the baseline and lowmem with
# their layers unrolled (the hidden=recompute rows of 2026-11-25 made room)
LLAMA_POLICIES = ("baseline", "lowmembp", "lowmem", "lowmem+qkv=recompute", "wta-crs",
                  "remat", "baseline+layers=unrolled", "lowmem+layers=unrolled")
# the combined preset, Mesa alone (is lowmem <= mesa8; mesa8's activation memory and speed
# against the baseline) and WTA-CRS under LoRA against JAX's own remat and offload
# policies (ViT-B LoRA, --peak); lowmem+offload: compiled for the H100 it is the one
# combination under timm+peft+checkpointing's 1279 MiB (docs/h100_compiled.md), its speed
# is the question; lowmem+attention_block=64: flash's score blocks of 50 keys in place of
# one of 197 (compiled: 1402 against lowmem's 1584 MiB), what the more steps cost;
# lowmem+qkv=recompute: q, k, v recomputed from the norm output's code (compiled: 1211
# MiB, without remat), and lowmembp+qkv=recompute+attention_block=64, with no Mesa codes at
# all (1280 MiB): what the three recomputed matmuls per block cost
REMAT_POLICIES = ("baseline", "lowmem", "mesa8", "wta-crs", "remat", "remat:dots_saveable",
                  "remat:save=qkv_proj,attn_out", "offload", "lowmem+offload",
                  "lowmem+attention_block=64", "lowmem+qkv=recompute",
                  "lowmembp+qkv=recompute+attention_block=64")


def _py(*args: str) -> list[str]:
  return [sys.executable, *args]


def _bench_cmd(out: Path, name: str, sets: Sequence[str], synthetic: int, steps: int,
               warmup: int, peak: bool, policies: Sequence[str] = BENCH_POLICIES,
               peers: bool = True) -> list[str]:
  """``train.bench``'s command line; with the peers, ``--profile`` too: where each run's
  device time goes, ours and the peers' alike."""
  cmd = _py("-m", "train.bench", "--synthetic", str(synthetic), "--policies",
            ",".join(policies), "--steps", str(steps), "--warmup", str(warmup),
            "--json", str(out / f"{name}.json"))
  cmd += ["--peers", "--profile"] if peers else []
  for item in sets:
    cmd += ["--set", item]
  return cmd + (["--peak"] if peak else [])


def _smoke_flag(module_file: Path) -> list[str]:
  """The tiny-run flag a benchmark module offers (``--smoke`` or ``--interpret``)."""
  text = module_file.read_text()
  return next(([f] for f in ("--smoke", "--interpret", "--tiny") if f'"{f}"' in text), [])


def _has_config_key(key: str) -> bool:
  from train.config import TrainConfig
  return key in {f.name for f in dataclasses.fields(TrainConfig)}


def tests_shard(k: int, n: int) -> list[str]:
  """The K-th of N parts of the test files (``tests/test_*.py`` by name, every N-th from
  the K-th), as paths relative to the checkout: one GPU call does not hold the suite."""
  files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py"))
  return files[k - 1::n]


def build_stages(out: Path, *, smoke: bool = False, peak: bool = False, workers: int = 12,
                 tests: Sequence[str] | None = None) -> list[Stage]:
  """Every stage, in run order, writing under ``out`` (``smoke``: tiny shapes, one test function,
  longer timeouts for a CPU)."""
  stages = [Stage("env", _py("-m", "lowmem_jax.gpu_check", "--env-json",
                             str(out / "env.json")), 60, 10, json_file="env.json")]

  train = _py("-m", "train")
  if _has_config_key("out_dir"):  # under DIR, not the default runs/ folder
    train += ["--set", f"out_dir={out / 'train-run'}"]
    train += ["--set", "overwrite=true"] if _has_config_key("overwrite") else []
  if smoke:
    train += ["--set", "steps=3", "--set", "eval_every=0", "--set", "model.num_layers=1",
              "--set", "batch_size=16", "--set", "compare_baseline=false"]
  stages.append(Stage("train", train, 90, 40))

  # --peers implies --peak when the peers ran on a GPU: PEERS_S holds both; --peak adds its
  # time only where the peers are missing (no torch), hence the max
  peak_s = 60 if peak else 0
  extra_timeout, extra_reserve = max(PEERS_S[0], peak_s), max(PEERS_S[1], peak_s)
  vit = ["model=vit-b16", "batch_size=64", "trainable=lora", "lora_rank=8",
         "lora_targets=query,value"]
  llama = ["task=lm", "model=llama-7b", "model.num_layers=4", "max_len=1024", "batch_size=4",
           "trainable=lora", "lora_rank=8", f"lora_targets={LLAMA_LORA_TARGETS}"]
  if smoke:
    vit[:2] = ["model=vit-tiny", "batch_size=4"]
    llama[1:5] = ["model=llama-tiny", "model.num_layers=1", "max_len=32", "batch_size=2"]
  steps, warmup, n = (1, 1, 8) if smoke else (10, 2, 128)
  policies = ("baseline", "lowmembp") if smoke else BENCH_POLICIES
  # 143 s on the H100 with five policies (75013e6); a sixth and the traces (--profile)
  # add an estimated 60 s: the timeout has room for them; the reserve stays, so the first
  # call's reserves still leave the tests two minutes of the default budget
  stages.append(Stage("bench-vit", _bench_cmd(out, "bench-vit", vit, n, steps, warmup, peak,
                                              policies),
                      180 + extra_timeout, 60 + extra_reserve, json_file="bench-vit.json"))
  policies = ("baseline", "lowmembp") if smoke else LLAMA_POLICIES
  stages.append(Stage("bench-llama", _bench_cmd(out, "bench-llama", llama, min(n, 32), steps,
                                                warmup, peak, policies),
                      180 + extra_timeout, 70 + extra_reserve, json_file="bench-llama.json"))
  remat = ("baseline", "remat") if smoke else REMAT_POLICIES
  stages.append(Stage("bench-remat", _bench_cmd(out, "bench-remat", vit, n, steps, warmup,
                                                not smoke, remat, peers=False),
                      400, 200, json_file="bench-remat.json"))

  kernel = _py("-m", "lowmem_jax.kernel_bench", "--json", str(out / "kernel-bench.json"))
  kernel += ["--interpret"] if smoke else ["--layers", "4"]
  stages.append(Stage("kernel-bench", kernel, 120, 45, json_file="kernel-bench.json"))

  attention_file = Path(__file__).with_name("attention_bench.py")
  attention = None
  if attention_file.exists():
    attention = _py("-m", "lowmem_jax.attention_bench", "--json",
                    str(out / "attention-bench.json"))
    attention += _smoke_flag(attention_file) if smoke else []
  stages.append(Stage("attention-bench", attention, 120, 45, json_file="attention-bench.json"))

  # eight fresh processes on an H100 (estimate, unmeasured: ~15-25 s each, compile-bound);
  # rows are written as they finish, so a cut stage keeps the reversible ones (run first)
  reversible = _py("-m", "benchmarks.reversible_depth", "--json",
                   str(out / "reversible-depth.json"), "--no-compile-rows")
  # smoke: --run, else a CPU makes no real-step row and, with --no-compile-rows, no row
  reversible += (["--smoke", "--run", "--variants", "lhs", "--depths", "2", "--steps", "1",
                  "--rounds", "1", "--warmup", "0"] if smoke else
                 ["--variants", "concurrent,vanilla-concurrent,stream,lhs", "--steps", "5",
                  "--rounds", "3", "--warmup", "1"])
  stages.append(Stage("reversible-depth", reversible, 200, 60,
                      json_file="reversible-depth.json",
                      env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}))

  # LLaMA-7B LoRA (32 layers, bf16 and nf4 bases): the largest batch per policy by
  # compiling, confirmed by running, and the HF + peft peer's (THIRD_CALL); rows are written
  # as they finish, the most telling first, so a cut stage keeps them
  fit = _py("-m", "benchmarks.llama_fit", "--json", str(out / "llama-fit.json"))
  fit += ["--smoke"] if smoke else ["--budget-s", str(LLAMA_FIT_S[1])]
  stages.append(Stage("llama-fit", fit, LLAMA_FIT_S[0], LLAMA_FIT_S[0] - 60,
                      json_file="llama-fit.json"))

  plan = _py("-m", "train", "--set", f"out_dir={out / 'train-plan-run'}", "--set",
             "overwrite=true", "--set", "eval_every=0", "--set", "trainable=lora", "--set",
             "lora_targets=query,value", "--set", "steps=3")
  plan += (["--set", "model=vit-tiny", "--set", "batch_size=8", "--set", "memory_budget=1GiB"]
           if smoke else ["--set", "model=vit-b16", "--set", "batch_size=64", "--set",
                          f"memory_budget={PLAN_BUDGET}"])
  # reserve 0: in --call 3 it gets what llama-fit leaves (run alone: --stages env,train-plan)
  stages.append(Stage("train-plan", plan, 240, 0, json_file="train-plan-run/metrics.jsonl"))

  junit = out / "tests-junit.xml"
  # -o addopts=: the project's "-n auto --maxprocesses 8" would cap --workers at 8, and
  # stop pytest outright where pytest-xdist is missing; -n is added below when it is there
  cmd = _py("-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-rfE",
            "--junitxml", str(junit), "-o", "junit_family=xunit1")
  workers = min(workers, 2) if smoke else workers
  if workers > 0 and find_spec("xdist") is not None:
    cmd += ["-n", str(workers)]
  if find_spec("pytest_timeout") is not None and not smoke:
    cmd += ["--timeout", "180"]  # one hung test must not eat the stage
  targets = list(tests) if tests else (
      ["tests/test_kernel_bench.py::test_spec_bandwidth_lookup"] if smoke else ["tests"])
  # GEMM autotuning off: the tests check values and compiled memory, not speed, and each
  # worker's compiles then skip timing every GEMM's candidate kernels (the suite's one
  # timeout on the H100 was a compile; the saving is unmeasured); it is also what the
  # deviceless compiles that set the GPU memory bounds (test_block_stack) do, as they
  # cannot time anything
  xla_flags = " ".join(filter(None, (os.environ.get("XLA_FLAGS"), TESTS_XLA_FLAGS)))
  stages.append(Stage("tests", cmd + targets, 400, 0, junit_file=junit.name,
                      env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                           "XLA_FLAGS": xla_flags}))
  if smoke:
    for stage in stages:
      stage.timeout_s *= SMOKE_TIMEOUT_FACTOR
  return stages


# ----------------------------------------------------------------------------- running
def _tail(path: Path, lines: int) -> str:
  if not path.exists():
    return ""
  return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _default_sigint() -> None:
  signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop(proc: subprocess.Popen) -> None:
  """SIGINT to the stage's process group (pytest writes its report), then SIGKILL."""
  for sig, wait in ((signal.SIGINT, KILL_GRACE_S), (signal.SIGKILL, 10)):
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      return
    try:
      proc.wait(wait)
      return
    except subprocess.TimeoutExpired:
      continue


def run_stage(stage: Stage, out: Path, timeout_s: float) -> dict:
  """Runs one stage: its status ("passed", "failed", "timeout", "missing", "skipped"),
  exit code, wall time, logs, its JSON output and (tests) the counts."""
  rec = {"name": stage.name, "cmd": None if stage.cmd is None else shlex.join(stage.cmd),
         "status": None, "exit_code": None, "wall_s": 0.0,
         "timeout_s": round(timeout_s, 1), "stdout": f"logs/{stage.name}.out",
         "stderr": f"logs/{stage.name}.err", "json_file": stage.json_file, "json": None}
  if stage.cmd is None:
    rec.update(status="missing", stdout=None, stderr=None)
    return rec
  if timeout_s < 1:
    rec.update(status="skipped", note="the budget is spent", stdout=None, stderr=None)
    return rec
  (out / "logs").mkdir(parents=True, exist_ok=True)
  # one persistent compilation cache for every stage: train.bench's parent then loads the
  # executables its --peak subprocesses compiled, instead of compiling each policy again
  env = {"JAX_COMPILATION_CACHE_DIR": str(out / XLA_CACHE), **os.environ, **stage.env}
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  start = time.perf_counter()
  with open(out / rec["stdout"], "w") as so, open(out / rec["stderr"], "w") as se:
    # SIGINT back to its default in the stage: a check started in the background (`&` in
    # a script, a pytest-xdist worker) runs with SIGINT ignored, which the stage would
    # inherit, and a timed-out pytest would then be killed without writing its report
    proc = subprocess.Popen(stage.cmd, cwd=ROOT, env=env, stdout=so, stderr=se,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_default_sigint)
    try:
      proc.wait(timeout_s)
      rec["status"] = "passed" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
      _stop(proc)
      rec["status"] = "timeout"
  rec["exit_code"] = proc.returncode
  rec["wall_s"] = round(time.perf_counter() - start, 1)
  rec["stdout_tail"] = _tail(out / rec["stdout"], 40)
  if rec["status"] != "passed":
    rec["stderr_tail"] = _tail(out / rec["stderr"], 30)
  if stage.json_file and (out / stage.json_file).exists():
    try:
      text = (out / stage.json_file).read_text()
      rec["json"] = ({"records": [json.loads(x) for x in text.splitlines() if x.strip()]}
                     if stage.json_file.endswith(".jsonl") else json.loads(text))
    except json.JSONDecodeError as e:
      rec["json_error"] = str(e)
  if stage.name == "train":
    rec["json"] = _last_json_line(rec["stdout_tail"])
  if stage.junit_file:
    rec["tests"] = count_tests(out / stage.junit_file, out / rec["stdout"])
  return rec


def _last_json_line(text: str) -> dict | None:
  for line in reversed(text.splitlines()):
    if line.startswith("{"):
      try:
        return json.loads(line)
      except json.JSONDecodeError:
        return None
  return None


def run_stages(stages: Sequence[Stage], out: Path, budget_s: float,
               on_stage=None) -> list[dict]:
  """Runs the stages in order within ``budget_s`` seconds: each gets its own timeout,
  cut so that the stages after it keep their ``reserve_s``."""
  deadline = time.perf_counter() + budget_s
  records = []
  for i, stage in enumerate(stages):
    reserve = sum(s.reserve_s for s in stages[i + 1:] if s.cmd is not None)
    timeout = min(stage.timeout_s, deadline - time.perf_counter() - reserve)
    print(f"[gpu_check] {stage.name}: " + ("missing" if stage.cmd is None else
          f"{shlex.join(stage.cmd)}  (timeout {max(timeout, 0):.0f} s)"), flush=True)
    rec = run_stage(stage, out, timeout)
    print(f"[gpu_check] {stage.name}: {rec['status']}"
          + ("" if rec["exit_code"] is None else f" (exit {rec['exit_code']})")
          + f" in {rec['wall_s']:.1f} s", flush=True)
    records.append(rec)
    if on_stage is not None:
      on_stage(records)
  return records


# ----------------------------------------------------------------------------- tests
def _nodeid(case: ET.Element) -> str:
  """``tests/test_x.py::TestA::test_b[p]`` from a JUnit testcase (xunit1 has ``file``)."""
  classname, name, file = case.get("classname", ""), case.get("name", ""), case.get("file")
  if file:
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file
    rest = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
    return "::".join(p for p in (file, rest, name) if p)
  return f"{classname}::{name}"


def parse_junit(path: Path) -> dict:
  """Passed/failed/error/skipped counts, the failing test ids and the slowest tests
  (``[id, seconds]``, SLOWEST of them; seconds of one worker) of a JUnit XML file."""
  counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
  failing, interrupted, times = [], 0, []
  for case in ET.parse(path).getroot().iter("testcase"):
    if not case.get("name"):  # the test running when pytest was interrupted
      interrupted += 1
      continue
    times.append((_nodeid(case), float(case.get("time") or 0.0)))
    tags = {child.tag for child in case}
    if "failure" in tags:
      counts["failed"] += 1
      failing.append(_nodeid(case))
    elif "error" in tags:
      counts["errors"] += 1
      failing.append(_nodeid(case) + " (error)")
    elif "skipped" in tags:
      counts["skipped"] += 1
    else:
      counts["passed"] += 1
  slowest = sorted(times, key=lambda t: -t[1])[:SLOWEST]
  return {**counts, "total": sum(counts.values()), "failing": failing,
          "interrupted": interrupted, "source": "junit",
          "test_s": round(sum(t for _, t in times), 1),
          "slowest": [[name, round(t, 1)] for name, t in slowest]}


def parse_pytest_log(text: str) -> dict:
  """Counts from pytest's last summary line and ``FAILED``/``ERROR`` lines (-rfE), for
  when no JUnit file was written (a hard kill)."""
  counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
  lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
  if lines:
    for num, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)",
                                lines[-1]):
      key = {"error": "errors", "xfailed": "skipped", "xpassed": "passed"}.get(word, word)
      counts[key] += int(num)
  failing = [m.group(2) + (" (error)" if m.group(1) == "ERROR" else "")
             for m in re.finditer(r"^(FAILED|ERROR) (\S+)", text, re.M)]
  return {**counts, "total": sum(counts.values()), "failing": failing,
          "interrupted": int("KeyboardInterrupt" in text), "source": "log"}


def count_tests(junit: Path, log: Path) -> dict:
  if junit.exists():
    try:
      return parse_junit(junit)
    except ET.ParseError:
      pass
  return parse_pytest_log(log.read_text(errors="replace") if log.exists() else "")


# ----------------------------------------------------------------------------- environment
def environment() -> dict:
  """The device and the versions, from inside a stage process (it touches the device)."""
  import platform

  import jax
  import jaxlib
  from jax._src import lib as jax_lib
  device = jax.devices()[0]
  info = {"device_kind": device.device_kind, "platform": device.platform,
          "device_count": jax.device_count(), "jax": jax.__version__,
          "jaxlib": jaxlib.__version__, "python": platform.python_version()}
  stats = device.memory_stats() or {}
  info["memory_bytes"] = stats.get("bytes_limit")
  versions = getattr(jax_lib, "cuda_versions", None)
  for name in ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version",
               "cublas_get_version"):
    try:
      info[name.replace("_get_version", "")] = getattr(versions, name)()
    except Exception:  # noqa: BLE001  (not a CUDA build, or an older plugin)
      info[name.replace("_get_version", "")] = None
  try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True,
                         timeout=20)
    info["nvidia_smi"] = smi.stdout.strip() or None
  except (OSError, subprocess.TimeoutExpired):
    info["nvidia_smi"] = None
  return info


def _cuda_text(v: int | None) -> str:
  return "-" if v is None else f"{v // 1000}.{v % 1000 // 10}"


def _cudnn_text(v: int | None) -> str:
  return "-" if v is None else f"{v // 10000}.{v % 10000 // 100}.{v % 100}"


def git_info(commit: str | None = None) -> dict:
  """The checkout's commit and whether it has local changes (None without git)."""
  def git(*args):
    try:
      p = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20)
      return p.stdout.strip() if p.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
      return None
  found = git("rev-parse", "HEAD")
  status = git("status", "--porcelain", "--untracked-files=no")
  if commit and not (found or "").startswith(commit):
    status = None  # another checkout's git (a copy laid over it): its changes say nothing
  return {"commit": commit or found, "from": "--commit" if commit else ("git" if found else None),
          "dirty": None if status is None else bool(status)}


def device_slug(kind: str | None) -> str:
  """``h100`` from ``NVIDIA H100 80GB HBM3``: the report's file name prefix."""
  if not kind:
    return "unknown"
  words = re.sub(r"^(nvidia|amd|google)\s+", "", kind.strip().lower()).split()
  return re.split(r"[-_]", words[0])[0] if words else "unknown"


# ----------------------------------------------------------------------------- report
def build_report(records: list[dict], *, args: dict, git: dict, started: str,
                 wall_s: float) -> dict:
  env = next((r["json"] for r in records if r["name"] == "env" and r["json"]), None) or {}
  tests = next((r.get("tests") for r in records if r["name"] == "tests"), None)
  by_status: dict[str, list[str]] = {}
  for r in records:
    by_status.setdefault(r["status"], []).append(r["name"])
  return {"report": "lowmem-jax gpu check", "started": started, "wall_s": round(wall_s, 1),
          "args": args, "git": git, "environment": env, "tests": tests,
          "stage_status": by_status, "stages": records}


def _train_figure(rec: dict) -> str | None:
  train = rec.get("json") or {}
  if "eval_accuracy" not in train:
    return None
  return (f"train (digits ViT): eval accuracy {train['eval_accuracy']:.4f}, "
          f"loss {train.get('eval_loss', float('nan')):.4f}")


def _plan_figure(rec: dict) -> str | None:
  """The plan ``python -m train`` chose under ``memory_budget`` and, after step 1, its
  predicted peak against ``peak_bytes_in_use`` (the run's metrics.jsonl)."""
  records = (rec.get("json") or {}).get("records") or []
  plan = next((r for r in records if r.get("event") == "plan"), None)
  if plan is None:
    return None
  gib = 2 ** 30
  line = (f"train-plan (memory_budget {plan['memory_budget'] / gib:.2f} GiB): "
          f"{plan['policy']} x grad_accum {plan['grad_accum']}, predicted peak "
          f"{plan['predicted_peak'] / gib:.3f} GiB")
  check = next((r for r in records if r.get("event") == "plan_check"), None)
  if check and check.get("real_peak"):
    line += (f", real {check['real_peak'] / gib:.3f} GiB (error "
             f"{check['error_pct']:+.2f}% of the real peak)")
  return line


def _bench_figure(rec: dict) -> str | None:
  """Our policies' step time, temp and peak; then the peers' step time and peak."""
  cells = []
  result = rec.get("json") or {}
  for r in result.get("rows") or []:
    queued = f" (queued {r['queued_ms']:.1f})" if r.get("queued_ms") else ""
    cell = f"{r['policy']} {r['step_ms']:.1f} ms{queued}, temp {r['temp_mib']:.0f} MiB"
    cell += f", peak {r['peak_mib']:.0f} MiB" if "peak_mib" in r else ""
    cells.append(cell + _profile_cell(r.get("profile")))
  for r in result.get("peers") or []:
    cell = f"{r['policy']} " + (f"{r['step_ms']:.1f} ms" if "step_ms" in r else "failed")
    cell += f", peak {r['peak_mib']:.0f} MiB" if "peak_mib" in r else ""
    cells.append(cell + _profile_cell(r.get("profile")))
  if result.get("peers_note"):
    cells.append(f"no peers: {result['peers_note']}")
  if result.get("partial"):  # cut short after the peaks: what the subprocesses measured
    cells += [f"{k} peak {v:.0f} MiB" for k, v in result.get("peaks_mib", {}).items()]
    for p in (result.get("peers_raw") or {}).get("peers", []):
      cell = f"{p['name']} " + ("failed" if "error" in p else f"{p['step_ms']:.1f} ms")
      cells.append(cell + (f", peak {p['peak_mib']:.0f} MiB" if p.get("peak_mib") else ""))
    cells.append("(partial: the timed run did not finish)")
  for spec, error in {**result.get("failed", {}), **result.get("peak_errors", {})}.items():
    cells.append(f"{spec} failed: {error[:120]}")
  return f"{rec['name']}: " + "; ".join(cells) if cells else None


def _profile_cell(profile: dict | None) -> str:
  """A traced run's device time per step (``train.bench --profile``): busy of wall, by kind."""
  from train.kernel_time import one_line
  return f", {one_line(profile)}" if profile else ""


def _kernel_figure(rec: dict) -> str | None:
  kernels = (rec.get("json") or {}).get("kernels") or {}
  copy = kernels.get("copy")
  if not copy:
    return None
  pct = "" if copy["pct_peak"] is None else f" ({copy['pct_peak']:.0f}% of peak)"
  flag = (" **LOW: kernel GB/s not trustworthy**" if copy["low"] else
          " **ABOVE PEAK: calls dropped, timings not trustworthy**"
          if copy.get("above_peak") else "")
  return (f"kernel-bench: measured copy {copy['Bps'] / 1e9:.0f} GB/s{pct}{flag}; "
          + ", ".join(f"{r['kernel']} failed" if "error" in r else
                      f"{r['kernel']} {r['pallas_GBps']:.0f} GB/s "
                      f"({r['speedup_vs_xla']:.2f}x XLA)" for r in kernels["rows"]))


def _reversible_figure(rec: dict) -> str | None:
  """Each real-step row's peak and its speed against vanilla reversible."""
  cells = [f"{r['case']} x{r['layers']} peak {r['peak_bytes_in_use'] / 2**20:.0f} MiB, "
           f"{r['step_ms']:.1f} ms ({r.get('speed_vs_reversible', float('nan')):.2f}x rev)"
           for r in (rec.get("json") or {}).get("run_rows") or [] if "error" not in r]
  return "reversible-depth: " + "; ".join(cells) if cells else None


def _llama_fit_figure(rec: dict) -> str | None:
  """Each row's largest batch (compiled / run), tokens/s, real peak and prediction error."""
  cells = []
  for r in (rec.get("json") or {}).get("rows") or []:
    name = f"{r['policy']} {r['base_dtype']}"
    if "error" in r or "missing" in r:
      cells.append(f"{name} " + ("failed" if "error" in r else f"missing {r['missing']}"))
      continue
    cell = (f"{name} batch {r.get('max_batch_aot', '-')}/{r['max_batch_run']} x {r['seq']}")
    if r.get("tokens_per_s"):
      cell += f" {r['tokens_per_s']:.0f} tok/s"
    if r.get("real_peak"):
      cell += f", peak {r['real_peak'] / 2**30:.1f} GiB"
    if r.get("error_pct") is not None:
      cell += f" (pred {r['error_pct']:+.1f}%)"
    cells.append(cell)
  return "llama-fit (batch AOT/run): " + "; ".join(cells) if cells else None


FIGURES = {"train": _train_figure, "bench-vit": _bench_figure, "bench-llama": _bench_figure,
           "bench-remat": _bench_figure,
           "kernel-bench": _kernel_figure, "reversible-depth": _reversible_figure,
           "llama-fit": _llama_fit_figure, "train-plan": _plan_figure}


def key_figures(report: dict) -> list[str]:
  """One line per benchmark with its headline numbers, read from the stages' JSON (a
  stage whose JSON has another shape is left out)."""
  lines = []
  for rec in report["stages"]:
    try:
      line = FIGURES[rec["name"]](rec) if rec["name"] in FIGURES else None
    except (KeyError, TypeError, ValueError):
      line = None
    if line:
      lines.append("- " + line)
  return lines


def _json_block(rec: dict) -> str:
  return "```\n" + rec.get("stdout_tail", "").strip() + "\n```"


def markdown(report: dict) -> str:
  """The short summary: device and versions, a stage table, test counts and failures,
  each benchmark's table (its printed output)."""
  env, git = report["environment"], report["git"]
  device = env.get("device_kind", "unknown device")
  title = (f"# lowmem-jax GPU check: {device}, jax {env.get('jax', '?')}"
           + (f" (CUDA {_cuda_text(env.get('cuda_runtime'))}, cuDNN "
              f"{_cudnn_text(env.get('cudnn'))})" if env.get("cudnn") else ""))
  commit = git.get("commit") or "unknown"
  lines = [title, "", f"Started {report['started']}, {report['wall_s']:.0f} s in all; commit "
           f"`{commit[:12]}`" + (" (with local changes)" if git.get("dirty") else "")
           + f"; `python -m lowmem_jax.gpu_check {' '.join(report['args']['argv'])}`.", ""]
  if env.get("nvidia_smi"):
    lines += [f"nvidia-smi: {env['nvidia_smi']}", ""]
  lines += ["| stage | status | exit | wall s | timeout s |", "|---|---|---:|---:|---:|"]
  for r in report["stages"]:
    exit_code = "" if r["exit_code"] is None else r["exit_code"]
    lines.append(f"| {r['name']} | {r['status']} | {exit_code} | {r['wall_s']:.1f} | "
                 f"{r['timeout_s']:.0f} |")
  tests = report["tests"]
  if tests is not None:
    lines += ["", f"**Tests**: {tests['passed']} passed, {tests['failed']} failed, "
              f"{tests['errors']} errors, {tests['skipped']} skipped"
              + (", interrupted by the timeout" if tests.get("interrupted") else "")
              + f" (from the {tests['source']})."]
    shown = tests["failing"][:40]
    lines += [f"- `{t}`" for t in shown]
    if len(tests["failing"]) > len(shown):
      lines.append(f"- ... and {len(tests['failing']) - len(shown)} more (report.json)")
    if tests.get("slowest"):
      lines += ["", f"Slowest tests ({tests['test_s']:.0f} s of worker time in all):"]
      lines += [f"- {t:.1f} s `{name}`" for name, t in tests["slowest"]]
  figures = key_figures(report)
  if figures:
    lines += ["", "**Key figures**", *figures]
  for r in report["stages"]:
    if r["name"] in ("env", "tests") or r["status"] in ("missing", "skipped"):
      continue
    lines += ["", f"## {r['name']} ({r['status']}, {r['wall_s']:.0f} s)", "", _json_block(r)]
    if r["status"] != "passed" and r.get("stderr_tail"):
      lines += ["", "stderr (last lines):", "```", r["stderr_tail"].strip()[-3000:], "```"]
  return "\n".join(lines) + "\n"


def _docs_paths(docs: Path, kind: str | None) -> tuple[Path, Path]:
  """``<docs>/<device>-<date>.md/.json``, with ``-2``, ``-3``... when taken."""
  base = f"{device_slug(kind)}-{datetime.date.today().isoformat()}"
  for i in range(1, 100):
    stem = base if i == 1 else f"{base}-{i}"
    md, js = docs / f"{stem}.md", docs / f"{stem}.json"
    if not md.exists() and not js.exists():
      return md, js
  raise FileExistsError(f"{docs}/{base}-*: too many reports")


# ----------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> dict | None:
  argv = list(sys.argv[1:] if argv is None else argv)
  ap = argparse.ArgumentParser(prog="python -m lowmem_jax.gpu_check", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", metavar="DIR",
                  help="where the logs, each stage's JSON and report.json/.md go "
                       "(default: runs/gpu-check-<time>)")
  ap.add_argument("--docs", nargs="?", const="docs/gpu", metavar="DIR",
                  help="also write the report as DIR/<device>-<date>.md and .json "
                       "(DIR default: docs/gpu), for committing")
  ap.add_argument("--stages", help=f"comma-separated subset of: {','.join(STAGES)}")
  ap.add_argument("--call", type=int, choices=sorted(CALLS),
                  help="the stages of the first (the default), second or third call")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny shapes and one test function (its parametrized cases): checks "
                       "the check on any backend (CPU)")
  ap.add_argument("--budget", type=float,
                  help=f"seconds for all stages together (default: {GPU_BUDGET_S:.0f}; "
                       f"--smoke: {SMOKE_BUDGET_S:.0f})")
  ap.add_argument("--peak", action="store_true",
                  help="train.bench also measures peak_bytes_in_use (+60 s per bench)")
  ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1),
                  help="pytest-xdist workers for the tests, 0: none (default: %(default)s; "
                       "--smoke: at most 2)")
  ap.add_argument("--tests", help="pytest arguments instead of the default test selection")
  ap.add_argument("--shard", metavar="K/N",
                  help="the tests stage runs the K-th of N parts of the test files (every "
                       "N-th by name, from the K-th): the suite over N calls")
  ap.add_argument("--commit", help="the commit to record (when the checkout has no .git)")
  ap.add_argument("--env-json", metavar="FILE", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)

  if args.env_json:  # the env stage's subprocess
    info = environment()
    Path(args.env_json).write_text(json.dumps(info, indent=2))
    print(json.dumps(info))
    return None

  # every argument checked before the run's folder is made
  if args.stages is not None and args.call:
    ap.error("--stages and --call both choose the stages: give one")
  chosen = CALLS[args.call or 1]
  if args.stages is not None:
    chosen = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(STAGES))
    if unknown:
      ap.error(f"--stages: unknown stage(s) {', '.join(unknown)}; valid: "
               f"{', '.join(STAGES)}")
    if not chosen:
      ap.error(f"--stages names no stage, got {args.stages!r}; valid: {', '.join(STAGES)}")
  cli_checks.above(ap, args, "--budget")
  cli_checks.at_least(ap, args, "--workers", minimum=0)
  try:
    tests = shlex.split(args.tests) if args.tests else None
  except ValueError as e:
    ap.error(f"--tests {args.tests}: {e}")
  if args.shard is not None:
    if tests is not None or args.smoke:
      ap.error("--shard splits the default test selection: not with --tests or --smoke")
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", args.shard)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
      ap.error(f"--shard expects K/N with 1 <= K <= N, got {args.shard!r}")
    tests = tests_shard(int(match[1]), int(match[2]))
  cli_checks.output_dir(ap, args, "--out", "--docs")

  started = datetime.datetime.now().astimezone()
  out = Path(args.out or f"runs/gpu-check-{started:%Y%m%d-%H%M%S}").resolve()
  out.mkdir(parents=True, exist_ok=True)
  stages = build_stages(out, smoke=args.smoke, peak=args.peak, workers=args.workers,
                        tests=tests)
  stages = [s for s in stages if s.name in chosen]
  git = git_info(args.commit)
  budget = args.budget or (SMOKE_BUDGET_S if args.smoke else GPU_BUDGET_S)  # None: default
  meta = {"argv": argv, "smoke": args.smoke, "budget_s": budget, "peak": args.peak,
          "out": str(out)}
  t0 = time.perf_counter()
  docs: dict = {}  # the device kind the --docs files are named for, and their paths

  def write(records):
    """The report so far, after every stage: in ``out``, and with ``--docs`` in the docs
    folder too (a call cut short by its caller still leaves the stages it finished
    there; the files are renamed once the env stage names the device)."""
    report = build_report(records, args=meta, git=git, started=started.isoformat(
        timespec="seconds"), wall_s=time.perf_counter() - t0)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    if args.docs:
      kind = report["environment"].get("device_kind")
      if "paths" not in docs or docs["kind"] != kind:
        for old in docs.get("paths", ()):
          old.unlink(missing_ok=True)
        Path(args.docs).mkdir(parents=True, exist_ok=True)
        docs.update(kind=kind, paths=_docs_paths(Path(args.docs), kind))
      md, js = docs["paths"]
      md.write_text(markdown(report))
      js.write_text(json.dumps(report, indent=2))
    return report

  report = write(run_stages(stages, out, budget, on_stage=write))
  print("\n" + markdown(report))
  print(f"[gpu_check] wrote {out / 'report.json'} and {out / 'report.md'}")
  if args.docs:
    print(f"[gpu_check] wrote {docs['paths'][0]} and {docs['paths'][1]}")
  return report


if __name__ == "__main__":
  main()
