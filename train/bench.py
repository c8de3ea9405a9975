r"""Memory and speed of the real training step under each memory policy, side by side.

    python -m train.bench                                   # digits ViT, all default policies
    python -m train.bench --policies baseline,lowmembp --steps 50 --json bench.json
    python -m train.bench --config-name minilm-text --set batch_size=32 --png bench.png
    python -m train.bench --peak                            # GPU: allocator peak per policy
    python -m train.bench --compile-only --policies baseline,lowmem,remat   # nothing runs
    python -m train.bench --compile-only --live   # + the most bytes live (buffer assignment)
    python -m train.bench --synthetic 64 --set model=llama-7b --set task=lm \
        --set model.num_layers=4 --set max_len=1024 --set batch_size=4   # no data files

For the config's model and batch, each policy gets its own :class:`train.trainer.Trainer`
(``cfg.replace(policy=spec)``), its own state and its own :class:`train.batches.Batches`.
The bench records the compiled memory of the train step (temporaries, arguments, total:
``Trainer.compiled_memory``'s figures, read off the executable that is then timed; with
what it launches per step, :mod:`lowmem_jax.hlo_kernels`), then
times the train steps of all policies interleaved in one process (round-robin, median
after warmup, ``jax.block_until_ready`` on the state), and reports each policy's memory
and speed as ratios to ``baseline`` (put first when not asked for): speed ratio =
baseline step time / step time; throughput in examples/s (tokens/s for ``task=lm``,
padding included, as the training loop counts). Then each policy again as the peers are
timed (``queued ms``: steps queued back to back on one device batch, so the host's
dispatch and batch feeding overlap the device; the peers' speed ratio is against this).
All states are resident at once while timing, so size the model for N policies'
parameters and optimizer states.

``--peak`` (GPU) also measures ``memory_stats()["peak_bytes_in_use"]`` of each policy in
a fresh subprocess (the allocator's peak cannot be reset within a process), run before
this process touches the device; on backends without ``memory_stats()`` it is skipped.

Caveats: CPU timings are only indicative (no accelerator, and CPU XLA fuses and
schedules differently). CPU compiled memory is XLA:CPU's buffer assignment, a proxy:
our models scan their blocks (``models.stack``), so remat's saving shows there too, but
XLA:GPU fuses and schedules otherwise. GPU runs are the reference for both memory and
speed.

``--peers`` runs the PyTorch peers of the bench's case (``benchmarks/peers.py``: timm ViT or
HF Llama, peft LoRA or full fine-tuning, with and without gradient checkpointing), each in
a subprocess with the bench's shapes, before this process touches the device, and adds
their rows (``torch+peft``, ``torch+peft+ckpt``; ``torch``... for full fine-tuning) to the
table and JSON (``"peers"``): step time, speed vs our baseline, peak and peak ratio. When
the peers ran on a GPU it implies ``--peak``, so our rows' peak stands beside theirs. A
missing package (torch, timm, peft, transformers) is one printed line, not a failure.
See :mod:`train.bench_peers` and docs/peers.md.

``--profile`` then traces each policy's queued steps (``jax.profiler``; the peers'
with ``torch.profiler``) and prints where the device time goes: per step, the device's
busy time against the wall time, kernel time by kind (matmul, attention, copy, other) and,
for ours, by the source line that launched the kernels (:mod:`train.kernel_time`). A CPU
trace holds no device kernels: a note, no figures.

``--synthetic N`` replaces the config's data by N random examples shaped for its model
(images and labels; or tokens, targets and a full loss mask; or tokens, mask and labels):
full-size models (ViT-B/16 at 224 px, LLaMA-7B widths) need no image folder or tokenizer.
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

import numpy as np

from lowmem_jax import cli_checks
from lowmem_jax.hlo_kernels import count_kernels
from lowmem_jax.memory import (MiB, compiled_memory, error_line, format_table, peak_buffers,
                               policy_list, write_json)
from lowmem_jax.policy import MemoryPolicy
from train import kernel_time
from train.batches import batch_items
from train.bench_peers import merge_peers, ran_on_gpu, run_peers
from train.config import TrainConfig, add_config_arguments, load_config

DEFAULT_POLICIES = ("baseline", "plain", "approx-bp", "ms-bp", "lowmembp", "remat",
                    "remat:dots_saveable", "remat:save=qkv_proj,attn_out", "lowmembp+remat",
                    "mesa8", "lowmembp+mesa8", "wta-crs")


def parse_policies(text: str | Sequence[str]) -> list[str]:
  """Policy specs from a comma-separated list (``remat:save=a,b`` kept whole), checked;
  ``baseline`` is put first when missing. ValueError naming an unknown or repeated one."""
  specs = policy_list(text if isinstance(text, str) else ",".join(text))
  seen: dict[MemoryPolicy, str] = {}
  for spec in specs:
    policy = MemoryPolicy.parse(spec)
    if policy in seen:
      raise ValueError(f"policy {spec!r} is listed twice (same as {seen[policy]!r})")
    seen[policy] = spec
  if MemoryPolicy() not in seen:
    specs.insert(0, "baseline")
  return specs


def _is_baseline(spec: str) -> bool:
  return MemoryPolicy.parse(spec) == MemoryPolicy()


class _Runner:
  """One policy's trainer, fed from its own batches: each call is one train step.

  The next batch goes to the device while the step runs (one-deep prefetch, as a real
  input pipeline would); the call returns the new state for ``block_until_ready``.
  """

  def __init__(self, trainer, batches):
    self.trainer, self.batches = trainer, batches
    self.batch = trainer.put(next(batches))
    self.metrics = None
    self.steps = 0

  def __call__(self):
    t = self.trainer
    self.metrics = t.step(self.batch)
    self.batch = t.put(next(self.batches))
    self.steps += 1
    return t.state


def synthetic_dataset(cfg: TrainConfig, n: int):
  """``n`` random examples shaped for the config's (preset) model, for speed and memory
  runs without data files."""
  from train.dataset import ArrayDataset
  from train.model import model_config
  if cfg.pretrained:
    raise ValueError("--synthetic works with model presets, not pretrained=<dir>")
  mc = model_config(cfg)
  rng = np.random.default_rng(cfg.seed)
  if cfg.task == "image":
    shape = (n, mc.image_size, mc.image_size, mc.channels)
    return ArrayDataset({
        "image": rng.standard_normal(shape, np.float32),
        "label": rng.integers(0, mc.num_labels, n).astype(np.int32)})
  tokens = rng.integers(0, mc.vocab_size, (n, cfg.max_len + 1)).astype(np.int32)
  if cfg.task == "lm":
    return ArrayDataset({"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
                                  "loss_mask": np.ones((n, cfg.max_len), bool)})
  return ArrayDataset({"tokens": tokens[:, :-1],
                                "mask": np.ones((n, cfg.max_len), bool),
                                "label": rng.integers(0, mc.num_labels, n).astype(np.int32)})


def train_dataset(cfg: TrainConfig, synthetic: int = 0):
  """The config's training set, or ``synthetic`` random examples when > 0."""
  if synthetic:
    return synthetic_dataset(cfg, synthetic)
  from train.datasets import make_datasets
  return make_datasets(cfg)[0]


def _make_runner(cfg: TrainConfig, spec: str, train_set):
  from train.batches import Batches
  from train.trainer import Trainer
  trainer = Trainer.create(cfg.with_policy(spec, resume=False))
  return _Runner(trainer, Batches(train_set, cfg.batch_size, seed=cfg.seed))


def _device_info() -> dict:
  import jax

  from lowmem_jax import gpu_target
  target = gpu_target.active()
  if target is not None:  # compiled for a GPU that is not here: nothing ran
    return {"device_kind": target.device_kind, "backend": "gpu", "device_count": 1,
            "jax_version": jax.__version__, "compile_target": target.name}
  device = jax.devices()[0]
  return {"device_kind": device.device_kind, "backend": jax.default_backend(),
          "device_count": jax.device_count(), "jax_version": jax.__version__}


# ----------------------------------------------------------------------------- peak (GPU)
def _peak_child(cfg: TrainConfig, spec: str, steps: int, out: str,
                synthetic: int = 0) -> None:
  """In a fresh process: run ``steps`` train steps of one policy, write its allocator peak."""
  import jax

  stats = jax.devices()[0].memory_stats()
  peak = None
  if stats is not None and "peak_bytes_in_use" in stats:
    runner = _make_runner(cfg, spec, train_dataset(cfg, synthetic))
    for _ in range(steps):
      jax.block_until_ready(runner())
    peak = int(jax.devices()[0].memory_stats()["peak_bytes_in_use"])
  Path(out).write_text(json.dumps({"policy": spec, "peak_bytes_in_use": peak,
                                   **_device_info()}))


def measure_peaks(argv_base: list[str], specs: Sequence[str],
                  steps: int) -> tuple[dict, dict] | None:
  """``({spec: peak_bytes_in_use}, {spec: error})``, each policy from its own subprocess:
  a policy whose subprocess fails gets its error (the last line of its stderr) and the
  others still run. None where the backend reports no ``memory_stats()`` (CPU)."""
  env = dict(os.environ)
  root = str(Path(__file__).resolve().parents[1])
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  peaks, errors = {}, {}
  with tempfile.TemporaryDirectory() as tmp:
    for i, spec in enumerate(specs):
      out = os.path.join(tmp, f"peak{i}.json")
      cmd = [sys.executable, "-m", "train.bench", *argv_base, "--policies", spec,
             "--steps", str(steps), "--peak-child", out]
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
      if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        errors[spec] = last[:500]
        print(f"peak [{spec}]: the subprocess failed (exit {proc.returncode}); its stderr "
              f"ends:\n{proc.stderr[-2000:]}", flush=True)
        continue
      result = json.loads(Path(out).read_text())
      if result["peak_bytes_in_use"] is None:
        print(f"note: --peak skipped: backend {result['backend']!r} reports no "
              "memory_stats()['peak_bytes_in_use'] (GPU only)", flush=True)
        return None
      peaks[spec] = result["peak_bytes_in_use"]
      print(f"peak [{spec}]: {peaks[spec] / MiB:.1f} MiB", flush=True)
  return peaks, errors


# ----------------------------------------------------------------------------- the bench
QUEUED_ROUNDS = 3  # rounds of time_queued: its median


def time_queued(runners: dict, steps: int, rounds: int = QUEUED_ROUNDS) -> dict[str, float]:
  """Seconds per step of each runner as the peers are timed (benchmarks/peers.py: one
  batch on the device, steps queued back to back, the device's time): ``steps`` steps on
  the runner's current batch, dispatched without waiting, over the wall time from the
  first dispatch to the last result; the median of ``rounds`` round-robin rounds. Beside
  :func:`time_interleaved`'s per-step figure (a new batch each step, waited for), the
  difference is what the host adds per step: dispatch, the batch, the wait."""
  import jax
  times = {name: [] for name in runners}
  for _ in range(rounds):
    for name, runner in runners.items():
      trainer, batch = runner.trainer, runner.batch
      jax.block_until_ready(trainer.state)
      start = time.perf_counter()
      for _ in range(steps):
        runner.metrics = trainer.step(batch)
      jax.block_until_ready(trainer.state)
      times[name].append((time.perf_counter() - start) / steps)
      runner.steps += steps
  return {name: statistics.median(t) for name, t in times.items()}


def profile_runners(runners: dict, steps: int) -> dict[str, dict | None]:
  """Each runner's ``steps`` steps queued on its batch (as :func:`time_queued`) under the
  JAX profiler: :func:`train.kernel_time.trace_steps`'s figures, the kernels grouped by
  the source line of the instruction that launched them; None where the trace holds no
  device kernels (CPU). After the timed runs, so tracing does not touch their times."""
  profiles = {}
  for name, runner in runners.items():
    trainer = runner.trainer
    compiled = trainer.compiled_step[1] if trainer.compiled_step else None
    where = kernel_time.hlo_sources(compiled.as_text()) if compiled is not None else None

    def queue(runner=runner, trainer=trainer):
      for _ in range(steps):
        runner.metrics = trainer.step(runner.batch)
      runner.steps += steps
      return trainer.state
    try:  # after the timed runs: a trace that fails costs its figures, not the bench's
      profiles[name] = kernel_time.trace_steps(queue, steps, where)
    except Exception as e:  # noqa: BLE001 - any profiler failure (no CUPTI, a busy session)
      print(f"warning: --profile [{name}] failed: {error_line(e)}", flush=True)
      profiles[name] = None
  return profiles


def run(cfg: TrainConfig, specs: Sequence[str], steps: int, warmup: int,
        peaks: dict | None = None, synthetic: int = 0, profile: bool = False) -> dict:
  """Compiled memory and interleaved step times of each policy; the JSON result.
  ``profile``: then each policy's device time traced (:func:`profile_runners`)."""
  from lowmem_jax.kernel_bench import time_interleaved

  if cfg.batch_size % cfg.grad_accum:
    raise ValueError(f"batch_size {cfg.batch_size} is not a multiple of grad_accum "
                     f"{cfg.grad_accum}")
  import jax

  train_set = train_dataset(cfg, synthetic)
  base = next(s for s in specs if _is_baseline(s))
  runners, memory, kernels, failed = {}, {}, {}, {}
  for spec in specs:
    try:  # built, compiled and one step run: a policy that cannot is reported, not fatal
      runner = _make_runner(cfg, spec, train_set)
      mem, kern = _compiled(runner)
      jax.block_until_ready(runner())
    except Exception as e:  # noqa: BLE001 - any failure of one policy, the baseline's fatal
      if spec == base:
        raise
      failed[spec] = error_line(e, 500)
      print(f"failed [{spec}]: {failed[spec]}", flush=True)
      continue
    runners[spec], memory[spec], kernels[spec] = runner, mem, kern
    print(_compiled_line(spec, mem, kern), flush=True)
  specs = [s for s in specs if s in runners]
  items = batch_items(runners[base].batch, cfg.task)
  unit = "tokens/s" if cfg.task == "lm" else "examples/s"
  # the step run above was each policy's first warmup step
  seconds = time_interleaved(runners, {spec: () for spec in specs}, rounds=steps,
                             warmup=warmup - 1)
  queued = time_queued(runners, steps)
  profiles = profile_runners(runners, min(steps, kernel_time.PROFILE_STEPS)) if profile else {}

  bmem, btime = memory[base], seconds[base]
  rows = []
  for spec in specs:
    mem, t, r = memory[spec], seconds[spec], runners[spec]
    row = {
        "policy": spec,
        "canonical_policy": MemoryPolicy.parse(spec).spec,
        "compiled": mem.as_dict(),
        "temp_mib": mem.temp / MiB, "temp_ratio": mem.temp / max(bmem.temp, 1),
        "argument_mib": mem.argument / MiB,
        "total_mib": mem.total / MiB, "total_ratio": mem.total / max(bmem.total, 1),
        **_kernel_fields(kernels[spec]),
        "step_ms": t * 1e3, "speed_ratio": btime / t,
        "throughput": items / t, "throughput_unit": unit,
        "queued_ms": queued[spec] * 1e3, "queued_speed_ratio": queued[base] / queued[spec],
        "steps_run": r.steps,
        "final_loss": float(r.metrics["loss"]),
        "finite": r.trainer.first_bad_step() is None,  # every step run
    }
    if profiles.get(spec):
      row["profile"] = profiles[spec]
    if peaks and spec in peaks:
      row["peak_bytes_in_use"] = peaks[spec]
      row["peak_mib"] = peaks[spec] / MiB
      if base in peaks:
        row["peak_ratio"] = peaks[spec] / max(peaks[base], 1)
    rows.append(row)
  result = {**_device_info(), "config": cfg.to_json(), "policies": list(specs),
            "baseline": base, "timed_steps": steps, "warmup_steps": warmup,
            "items_per_step": items, "throughput_unit": unit, "synthetic": synthetic,
            "rows": rows}
  return {**result, "failed": failed} if failed else result


def compile_only(cfg: TrainConfig, specs: Sequence[str], synthetic: int = 0,
                 live: bool = False) -> dict:
  """Compiled memory of each policy's train step, nothing run (``--compile-only``): the
  JSON result, rows without step times. One trainer at a time, so host memory holds one
  model. ``live``: also the most distinct bytes live at any point of the step's schedule
  (:func:`lowmem_jax.memory.peak_buffers`, one more compile per policy), with the five
  source lines holding the most of them."""
  train_set = train_dataset(cfg, synthetic)
  base_spec = next(s for s in specs if _is_baseline(s))
  memory, kernels, peaks, failed = {}, {}, {}, {}
  for spec in specs:
    try:  # a policy that cannot build or compile is reported, not fatal (the baseline is)
      runner = _make_runner(cfg, spec, train_set)
      trainer = runner.trainer
      memory[spec], kernels[spec] = _compiled(runner)
      line = _compiled_line(spec, memory[spec], kernels[spec])
      if live:
        peaks[spec] = peak_buffers(trainer.train_step, trainer.state, trainer.first_bad,
                                   runner.batch)
        line += f", live at the peak {peaks[spec].peak_bytes / MiB:.1f} MiB"
      del runner, trainer
    except Exception as e:  # noqa: BLE001 - any failure of one policy, the baseline's fatal
      if spec == base_spec:
        raise
      memory.pop(spec, None)
      failed[spec] = error_line(e, 500)
      line = f"failed [{spec}]: {failed[spec]}"
    print(line, flush=True)
  base = memory[base_spec]
  rows = [{"policy": spec, "canonical_policy": MemoryPolicy.parse(spec).spec,
           "compiled": mem.as_dict(), "temp_mib": mem.temp / MiB,
           "temp_ratio": mem.temp / max(base.temp, 1), "argument_mib": mem.argument / MiB,
           "total_mib": mem.total / MiB, "total_ratio": mem.total / max(base.total, 1),
           **_kernel_fields(kernels[spec]),
           "step_ms": None, "speed_ratio": None, "throughput": None}
          for spec, mem in memory.items()]
  for row in rows if live else ():
    peak = peaks[row["policy"]]
    row.update(live_mib=peak.peak_bytes / MiB,
               live_ratio=peak.peak_bytes / max(peaks[base_spec].peak_bytes, 1),
               live_by_source=[{"source": s, "mib": n / MiB, "buffers": c}
                               for s, n, c in peak.by_source()[:5]])
  unit = "tokens/s" if cfg.task == "lm" else "examples/s"
  result = {**_device_info(), "config": cfg.to_json(), "policies": list(memory),
            "baseline": base_spec, "timed_steps": 0, "warmup_steps": 0,
            "synthetic": synthetic, "throughput_unit": unit, "rows": rows}
  return {**result, "failed": failed} if failed else result


def _compiled(runner):
  """The policy's train step compiled: its memory and what it launches per step."""
  compiled = runner.trainer.compile(runner.batch)
  return compiled_memory(compiled), count_kernels(compiled.as_text())


def _compiled_line(spec: str, mem, kern) -> str:
  return (f"compiled [{spec}]: temp {mem.temp / MiB:.1f} MiB, total {mem.total / MiB:.1f} "
          f"MiB, {kern.launches} kernel launches per step, "
          f"{kern.stack_copy_bytes / MiB:.0f} MiB copied in and out of layer stacks")


def _kernel_fields(kern) -> dict:
  return {"launches": kern.launches, "stack_copies": kern.stack_copies,
          "stack_copy_mib": kern.stack_copy_bytes / MiB}


def _fmt(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def table(result: dict) -> str:
  """Our policies' rows, then the peers' (``--peers``; no compiled memory: ``-``)."""
  peers = result.get("peers", [])
  peak = any("peak_mib" in r for r in result["rows"] + peers)
  live = any("live_mib" in r for r in result["rows"])
  headers = ["policy", "temp MiB", "ratio", "total MiB", "ratio"]
  headers += ["live MiB", "ratio"] if live else []
  launches = any("launches" in r for r in result["rows"])
  headers += ["launches", "stack copy MiB"] if launches else []
  headers += ["step ms", "speed vs base", result["throughput_unit"]]
  queued = any("queued_ms" in r for r in result["rows"])
  headers += ["queued ms", "speed vs base"] if queued else []
  if peak:
    headers += ["peak MiB", "ratio"]
  rows = []
  for r in result["rows"]:
    row = [r["policy"], f"{r['temp_mib']:.1f}", f"{r['temp_ratio']:.3f}",
           f"{r['total_mib']:.1f}", f"{r['total_ratio']:.3f}"]
    row += [f"{r['live_mib']:.1f}", f"{r['live_ratio']:.3f}"] if live else []
    row += [_fmt(r.get("launches"), "d"), _fmt(r.get("stack_copy_mib"), ".0f")] if (
        launches) else []
    row += [_fmt(r["step_ms"], ".2f"), _fmt(r["speed_ratio"], ".3f"),
            _fmt(r["throughput"], ".0f")]
    row += [_fmt(r.get("queued_ms"), ".2f"), _fmt(r.get("queued_speed_ratio"), ".3f")] if (
        queued) else []
    if peak:
      row += ([f"{r['peak_mib']:.1f}", _fmt(r.get("peak_ratio"), ".3f")] if "peak_mib" in r
              else ["-", "-"])
    rows.append(row)
  for r in peers:
    row = [r["policy"], "-", "-", "-", "-"] + (["-", "-"] if live else [])
    row += ["-", "-"] if launches else []
    row += (["failed", "-", "-"] if "step_ms" not in r else
            [f"{r['step_ms']:.2f}", "-" if queued else f"{r['speed_ratio']:.3f}",
             f"{r['throughput']:.0f}"])
    if queued:  # a peer is timed one way, queued: its ratio is against our queued base
      row += (["-", "-"] if "queued_speed_ratio" not in r else
              [f"{r['step_ms']:.2f}", f"{r['queued_speed_ratio']:.3f}"])
    if peak:
      row += [f"{r['peak_mib']:.1f}" if "peak_mib" in r else "-",
              f"{r['peak_ratio']:.3f}" if "peak_ratio" in r else "-"]
    rows.append(row)
  return format_table(headers, rows)


def print_profiles(result: dict) -> None:
  """``--profile``'s tables: device time per step by kernel kind for every traced run,
  then each run's time by source line."""
  profiles = {r["policy"]: r["profile"] for r in result["rows"] + result.get("peers", [])
              if r.get("profile")}
  if not profiles:
    print("note: --profile: the traces held no device kernels (a CPU backend, or a GPU "
          "profiler without CUPTI); nothing to break down", flush=True)
    return
  print(f"\ndevice time per step, traced ({next(iter(profiles.values()))['steps']} queued "
        "steps; kind from the kernel's name)")
  print(kernel_time.table(profiles))
  for name, profile in profiles.items():
    print(kernel_time.top_table(name, profile))


def plot(result: dict, path: str) -> bool:
  """Memory and throughput bar charts side by side (as in the LowMemoryBP paper's
  figure); False, with a note, when matplotlib is not installed."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(f"note: matplotlib is not installed; skipping the PNG {path} "
          "(pip install matplotlib to draw it)", flush=True)
    return False
  rows = result["rows"]
  names = [r["policy"] for r in rows]
  x = range(len(rows))
  peak = all("peak_mib" in r for r in rows)
  mem_key, mem_label = (("peak_mib", "peak memory in use (MiB)") if peak
                        else ("total_mib", "compiled step memory, total (MiB)"))
  fig, (ax_mem, ax_speed) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows)), 4.5))
  panels = ((ax_mem, [r[mem_key] for r in rows], mem_label, "tab:blue"),
            (ax_speed, [r["throughput"] for r in rows],
             f"throughput ({result['throughput_unit']})", "tab:orange"))
  ratios = ([r.get("peak_ratio", math.nan) if peak else r["total_ratio"] for r in rows],
            [r["speed_ratio"] for r in rows])
  for (ax, values, label, color), ratio in zip(panels, ratios):
    bars = ax.bar(x, values, color=color, label="total" if ax is ax_mem else None)
    if not peak and ax is ax_mem:  # temporaries as the inner part of the total
      ax.bar(x, [r["temp_mib"] for r in rows], color="tab:cyan", width=0.5,
             label="temporaries")
      ax.legend(loc="lower right", fontsize=8)
    for bar, q in zip(bars, ratio):
      ax.annotate(f"{q:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                  ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(label)
    ax.margins(y=0.12)
  cfg = result["config"]
  fig.suptitle(f"{cfg['pretrained'] or cfg['model']}, batch {cfg['batch_size']}, "
               f"{cfg['dtype']} - {result['device_kind']} ({result['backend']})", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  print(f"wrote {path}")
  return True


def main(argv: Sequence[str] | None = None) -> dict | None:
  ap = argparse.ArgumentParser(prog="python -m train.bench", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  add_config_arguments(ap)
  ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                  help="comma-separated policy specs (default: %(default)s)")
  ap.add_argument("--steps", type=int, default=20,
                  help="timed steps per policy, after warmup (default: %(default)s)")
  ap.add_argument("--warmup", type=int, default=3,
                  help="untimed steps per policy first, compilation included "
                       "(default: %(default)s)")
  ap.add_argument("--peak", action="store_true",
                  help="GPU: also measure peak_bytes_in_use, each policy in a fresh subprocess")
  ap.add_argument("--peers", action="store_true",
                  help="also run the PyTorch peers (benchmarks/peers.py) with the same shapes, "
                       "with and without gradient checkpointing; on a GPU implies --peak")
  ap.add_argument("--profile", action="store_true",
                  help="after timing, trace each policy's queued steps (and the peers') and "
                       "break their device time down by kernel kind and source line (GPU)")
  ap.add_argument("--synthetic", type=int, default=0, metavar="N",
                  help="N random examples shaped for the model instead of the config's data")
  ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
  ap.add_argument("--png", metavar="FILE", help="draw memory and throughput bars (matplotlib)")
  ap.add_argument("--compile-only", action="store_true",
                  help="compiled memory of each policy's step only: nothing runs (no "
                       "timing, peak or peers)")
  ap.add_argument("--live", action="store_true",
                  help="with --compile-only: also the most distinct bytes live at any point "
                       "of each step's schedule, read off XLA's buffer assignment")
  ap.add_argument("--target", metavar="GPU",
                  help="with --compile-only: compile for this GPU instead of the local "
                       "backend (lowmem_jax.gpu_target: h100; no GPU needed)")
  ap.add_argument("--peak-child", metavar="FILE", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  cli_checks.at_least(ap, args, "--steps", "--warmup")
  cli_checks.at_least(ap, args, "--synthetic", minimum=0)
  cli_checks.output_file(ap, args, "--json", "--png")
  specs = parse_policies(args.policies)
  # checked under the last policy asked for (a wta-crs row's options are valid there; each
  # row then takes its own policy, TrainConfig.with_policy)
  cfg = load_config(args.config_name, args.config, [f"policy={specs[-1]}", *args.set])

  if args.peak_child:  # the subprocess of --peak: one policy, one number
    # parse_policies puts baseline first when missing: the policy asked for is the last
    _peak_child(cfg, specs[-1], args.warmup + args.steps, args.peak_child, args.synthetic)
    return None

  if (args.live or args.target) and not args.compile_only:
    ap.error("--live and --target go with --compile-only")
  if args.compile_only:
    if args.peak or args.peers or args.png:
      ap.error("--compile-only runs nothing: it takes no --peak, --peers or --png")
    from lowmem_jax import gpu_target
    with gpu_target.compiling_for(args.target):
      result = compile_only(cfg, specs, args.synthetic, live=args.live)
    where = ("deviceless compile for it, nothing run" if args.target else "compiled only")
    print(f"\n{cfg.pretrained or cfg.model} ({cfg.task}), batch {cfg.batch_size}, "
          f"{cfg.dtype}; {result['device_kind']} ({result['backend']}), jax "
          f"{result['jax_version']}; {where}")
    print(table(result))
    for spec, error in result.get("failed", {}).items():
      print(f"{spec}: failed: {error}")
    write_json(args.json, result)
    return result

  # the peers and the peaks run before this process allocates on the device (XLA preallocates)
  peers = run_peers(cfg, args.steps, args.warmup, args.profile) if args.peers else None
  peaks, peak_errors = None, {}
  if args.peak or (peers is not None and ran_on_gpu(peers)):
    base_argv = ["--warmup", str(args.warmup), "--synthetic", str(args.synthetic)]
    base_argv += ["--config-name", args.config_name] if args.config_name else []
    base_argv += ["--config", args.config] if args.config else []
    for item in args.set:
      base_argv += ["--set", item]
    peaks, peak_errors = measure_peaks(base_argv, specs, min(args.steps, 3)) or (None, {})
    # what is measured so far, kept should the timed run below be cut short
    write_json(args.json, {"partial": "peers and peaks only: the timed run did not finish",
                           "config": cfg.to_json(), "policies": list(specs),
                           "peaks_mib": {k: v / MiB for k, v in (peaks or {}).items()},
                           "peak_errors": peak_errors, "peers_raw": peers})

  result = run(cfg, specs, args.steps, args.warmup, peaks, args.synthetic, args.profile)
  if peak_errors:
    result["peak_errors"] = peak_errors
  if peers is not None:
    result = merge_peers(result, peers)
  model = cfg.pretrained or cfg.model
  print(f"\n{model} ({cfg.task}), batch {cfg.batch_size}, {cfg.dtype}, "
        f"overrides {cfg.model_overrides or '{}'}; {result['device_kind']} "
        f"({result['backend']}), jax {result['jax_version']}; median of {args.steps} "
        f"interleaved steps after {args.warmup} warmup, a new batch each; queued: the "
        f"median of {QUEUED_ROUNDS} rounds of {args.steps} steps queued on one batch, as the "
        "peers are timed")
  print(table(result))
  for spec, error in {**result.get("failed", {}), **result.get("peak_errors", {})}.items():
    print(f"{spec}: failed: {error}")
  for r in result.get("peers", []):
    if "peak_minus_resident_mib" in r:
      print(f"{r['policy']}: resident {r['resident_mib']:.1f} MiB before the step, peak - "
            f"resident {r['peak_minus_resident_mib']:.1f} MiB ({r['peer']['device_name']}, "
            f"torch {r['peer']['versions']['torch']})")
  if args.profile:
    print_profiles(result)
  if result["backend"] == "cpu":
    print("note: CPU timings are only indicative, and XLA:CPU's buffer assignment is not "
          "XLA:GPU's; GPU runs are the reference for memory and speed.")
  write_json(args.json, result)
  if args.png:
    plot(result, args.png)
  return result


def cli() -> None:
  """Entry point: a clear one-line error for bad configs, policies and data."""
  from lowmem_jax.gpu_target import TargetUnavailable
  try:
    main(sys.argv[1:])
  except (ValueError, FileNotFoundError, TargetUnavailable) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  cli()
