"""RevViT-B activation memory against depth, and PaReprop's speed against vanilla reversible.

    python -m benchmarks.reversible_depth --json FILE      # revvit-b16, 12 vs 24 layers
    python -m benchmarks.reversible_depth --smoke          # tiny widths: checks the script
    python -m benchmarks.reversible_depth --compile-only   # no real steps, on any backend

**Compile-only rows** (every backend): one gradient step of the model (the loss and the
gradients of every parameter: what an optimizer update consumes) under ``baseline`` (plain
autodiff of the same reversible blocks: per-layer residuals), ``reversible`` and
``pareprop``, at each depth, lowered from abstract shapes and compiled, never run.
``memory_analysis()`` keeps the bytes apart: arguments (parameters, batch) and outputs
(gradients) grow with depth under every policy; ``temp`` is what the step needs beyond them
(activations, residuals, workspace), flat in depth for a reversible stack.

**Real steps** (by default where ``memory_stats()`` reports a peak: a GPU; ``--run`` /
``--compile-only`` force it): each case in a fresh subprocess (the allocator's peak is
process-lifetime), the model built on the CPU and then put on the device. The child reports
the compiled memory of the executable it runs, ``bytes_in_use`` before the first step
(resident: parameters and batch), ``peak_bytes_in_use`` after the warmup steps, and the step
time: ``--rounds`` rounds of ``--steps`` back-to-back dispatches with one sync at the end
(steps are milliseconds long: the device sets the pace, not the host), median per step.
Speeds are ratios to vanilla ``reversible`` and to ``baseline`` at the same depth, from the
same run. Variant rows (``--variants``) run PaReprop (and vanilla, as the control of an
option that may speed both) with XLA scheduling options, each in
its own process with ``XLA_FLAGS`` set in its environment (a flag this XLA release does not
know aborts that child only: its row records the error), and ``pareprop-stream``
(:mod:`lowmem_jax.reversible`: the rebuild under JAX's GPU stream annotation).
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

import jax
import jax.numpy as jnp

from lowmem_jax import cli_checks, gpu_target
from lowmem_jax.hlo_kernels import async_overlaps
from lowmem_jax.memory import MiB, compiled_memory, format_table, policy_list, write_json

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("baseline", "reversible", "pareprop")
# name -> (policy, XLA_FLAGS): flags checked to exist in jaxlib 0.10.2's XLA (its flag
# table); latency hiding is off by default on the GPU, the highest-priority async stream
# on by default (that row is a control: it should time like plain pareprop). One stream
# runs its kernels in order, so PaReprop's rebuild can only overlap the gradient on a
# second stream or in a CUDA graph's concurrent regions ("concurrent": compiled for an
# H100, XLA then plans buffers for concurrency, pareprop's temp 73.2 -> 164.7 MiB at
# depth 2, batch 4; vanilla's, its control, 62.9 -> 149.4).
CONCURRENT = "--xla_gpu_graph_enable_concurrent_region=true"
VARIANTS = {
    "concurrent": ("pareprop", CONCURRENT),
    "vanilla-concurrent": ("reversible", CONCURRENT),
    "lhs": ("pareprop", "--xla_gpu_enable_latency_hiding_scheduler=true"),
    "priority": ("pareprop", "--xla_gpu_enable_highest_priority_async_stream=true"),
    "stream": ("reversible=pareprop-stream", ""),
    "stream+lhs": ("reversible=pareprop-stream",
                   "--xla_gpu_enable_latency_hiding_scheduler=true"),
}
FULL = dict(model="revvit-b16", depths=(12, 24), batch=4, run_batch=32, overrides={})
SMOKE = dict(model="revvit-tiny", depths=(2, 4), batch=2, run_batch=2,
             overrides=dict(dim=32, mlp_dim=64, num_heads=2))


# ----------------------------------------------------------------------------- the step
def grad_step(graphdef, params, rest, inputs, targets):
  """Loss and the gradients of all Params: outputs param-sized, so temp excludes them."""
  from flax import nnx

  from models.step_memory import loss_fn

  def loss_of(p):
    return loss_fn(nnx.merge(graphdef, p, rest, copy=True), inputs, targets)

  return jax.value_and_grad(loss_of)(params)


def _nbytes(tree) -> int:
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def compile_row(model: str, spec: str, layers: int, batch: int, dtype, overrides: dict) -> dict:
  """Compiled memory of the gradient step, from abstract shapes (nothing allocated)."""
  from models.step_memory import step_args
  graphdef, params, rest, inputs, targets = step_args(
      model, spec, batch, 0, dtype, dict(overrides, num_layers=layers))
  args = gpu_target.place((params, rest, inputs, targets))  # unchanged without a target
  compiled = jax.jit(grad_step).lower(graphdef, *args).compile()
  return {"policy": spec, "layers": layers, "batch": batch, "param_bytes": _nbytes(params),
          "compiled": compiled_memory(compiled).as_dict(), "async_overlap": overlap(compiled)}


def overlap(compiled) -> list[int]:
  """Per asynchronous op of the compiled step (``pareprop-stream``'s rebuild on its own
  stream, a host copy), the launches scheduled between its start and its done, sorted
  (:func:`lowmem_jax.hlo_kernels.async_overlaps`): all 0, and nothing can run beside it."""
  return sorted(async_overlaps(compiled.as_text()).values())


def depth_growth(rows: Sequence[dict], field: str = "compiled") -> dict:
  """Per policy: temp and argument + output bytes at the least and greatest depth, and
  their growth per added layer (real-step rows: also the peak beyond params and grads)."""
  out = {}
  for spec in dict.fromkeys(r["policy"] for r in rows):
    mine = sorted((r for r in rows if r["policy"] == spec and r.get(field)),
                  key=lambda r: r["layers"])
    if len(mine) < 2:
      continue
    lo, hi = mine[0], mine[-1]
    added = hi["layers"] - lo["layers"]
    io = lambda r: r[field]["argument"] + r[field]["output"]
    out[spec] = {"layers": [lo["layers"], hi["layers"]],
                 "temp": [lo[field]["temp"], hi[field]["temp"]],
                 "temp_growth_per_layer": (hi[field]["temp"] - lo[field]["temp"]) / added,
                 "argument_output": [io(lo), io(hi)],
                 "argument_output_growth_per_layer": (io(hi) - io(lo)) / added}
    if lo.get("peak_beyond_params_grads") is not None and hi.get("peak_beyond_params_grads") is not None:
      beyond = [lo["peak_beyond_params_grads"], hi["peak_beyond_params_grads"]]
      out[spec].update(peak_beyond_params_grads=beyond,
                       peak_growth_per_layer=(beyond[1] - beyond[0]) / added)
  return out


# ----------------------------------------------------------------------------- real steps
def run_case(case: dict) -> dict:
  """In a fresh process: build on the CPU, put on the device, compile, run; the figures."""
  import numpy as np
  from flax import nnx

  from models import registry
  from models.step_memory import example_batch

  device = jax.devices()[0]
  dtype = jnp.dtype(case["dtype"])
  with jax.default_device(jax.devices("cpu")[0]):
    model = registry.build(case["model"], case["policy"], dtype=dtype, rngs=nnx.Rngs(0),
                           num_layers=case["layers"], **case["overrides"])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    inputs, targets = example_batch(model, case["batch"], 0)
    rng = np.random.default_rng(0)
    inputs = rng.standard_normal(inputs.shape).astype(np.float32)
    targets = rng.integers(0, model.cfg.num_labels, targets.shape).astype(np.int32)
  args = jax.device_put((params, rest, inputs, targets), device)
  del model, params, rest
  stats = device.memory_stats() or {}
  resident = stats.get("bytes_in_use")
  step = jax.jit(grad_step).lower(graphdef, *args).compile()
  for _ in range(case["warmup"]):
    jax.block_until_ready(step(graphdef, *args))
  peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
  times = []
  for _ in range(case["rounds"]):
    start = time.perf_counter()
    for _ in range(case["steps"]):
      out = step(graphdef, *args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / case["steps"])
    del out
  loss = float(step(graphdef, *args)[0])
  return {"param_bytes": _nbytes(args[0]), "compiled": compiled_memory(step).as_dict(),
          "async_overlap": overlap(step),
          "resident_bytes": resident, "peak_bytes_in_use": peak,
          "step_ms": statistics.median(times) * 1e3, "finite": math.isfinite(loss),
          "device_kind": device.device_kind, "backend": jax.default_backend(),
          "jax_version": jax.__version__}


def _child(case: dict, xla_flags: str, timeout_s: float) -> dict:
  """``run_case`` in a subprocess with ``xla_flags`` added to ``XLA_FLAGS``."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS"), xla_flags) if f)
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "case.json"
    cmd = [sys.executable, "-m", "benchmarks.reversible_depth", "--child", json.dumps(case),
           "--child-out", str(out)]
    try:
      proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=timeout_s)
    except subprocess.TimeoutExpired:
      return {"error": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0 or not out.exists():
      return {"error": f"exit {proc.returncode}: " + proc.stderr.strip()[-1500:]}
    return json.loads(out.read_text())


def run_cases(cfg: dict, policies: Sequence[str], variants: Sequence[str], *, steps: int,
              rounds: int, warmup: int, timeout_s: float, on_row=None) -> list[dict]:
  """Every (policy, depth) case, then the variants at the least depth; a process each.
  Order: reversible cases first (the claim), baseline after, variants last."""
  base = dict(model=cfg["model"], batch=cfg["run_batch"], dtype=cfg["dtype"],
              overrides=cfg["overrides"], steps=steps, rounds=rounds, warmup=warmup)
  order = sorted(policies, key=lambda p: p == "baseline")
  todo = [(p, p, d, "") for p in order for d in cfg["depths"]]
  for v in variants:
    spec, flags = VARIANTS[v]
    schedule = "reversible" if spec == "reversible" else "pareprop"
    todo.append((f"{schedule}[{v}]", spec, min(cfg["depths"]), flags))
  rows = []
  for name, spec, layers, flags in todo:
    row = {"case": name, "policy": spec, "layers": layers, "xla_flags": flags,
           **_child(dict(base, policy=spec, layers=layers), flags, timeout_s)}
    rows.append(row)
    print(f"ran [{name} x {layers}]: " + (row["error"].splitlines()[-1] if "error" in row
          else f"peak {_mib(row['peak_bytes_in_use'])} MiB, {row['step_ms']:.2f} ms"),
          flush=True)
    if on_row is not None:
      on_row(rows)
  _add_ratios(rows)
  return rows


def _add_ratios(rows: list[dict]) -> None:
  """Speed of each row vs vanilla reversible and vs baseline at its depth (same run)."""
  ms = {(r["case"], r["layers"]): r.get("step_ms") for r in rows}
  for r in rows:
    for ref in ("reversible", "baseline"):
      t = ms.get((ref, r["layers"]))
      if t and r.get("step_ms"):
        r[f"speed_vs_{ref}"] = t / r["step_ms"]
    if r.get("peak_bytes_in_use") is not None and r.get("resident_bytes") is not None:
      # beyond parameters, batch and the gradients (the step's outputs, param-sized)
      r["peak_beyond_params_grads"] = (r["peak_bytes_in_use"] - r["resident_bytes"]
                                       - r["param_bytes"])


# ----------------------------------------------------------------------------- tables
def _mib(b) -> str:
  return "-" if b is None else f"{b / MiB:.1f}"


def compile_table(rows, growth) -> str:
  body = [(r["policy"], r["layers"], _mib(r["compiled"]["temp"]), _mib(r["compiled"]["argument"]),
           _mib(r["compiled"]["output"])) for r in rows]
  table = format_table(("policy", "layers", "temp MiB", "argument MiB", "output MiB"), body)
  lines = [f"{p}: temp {_mib(g['temp'][0])} -> {_mib(g['temp'][1])} MiB "
           f"({g['temp_growth_per_layer'] / MiB:+.2f} MiB/layer); arguments + outputs "
           f"{g['argument_output_growth_per_layer'] / MiB:+.2f} MiB/layer"
           for p, g in growth.items()]
  return table + "\n" + "\n".join(lines)


def run_table(rows) -> str:
  def speed(r, ref):
    return f"{r[f'speed_vs_{ref}']:.3f}" if f"speed_vs_{ref}" in r else "-"

  body = []
  for r in rows:
    if "error" in r:
      body.append((r["case"], r["layers"], "error", "", "", "", "", "", "", "", ""))
      continue
    body.append((r["case"], r["layers"], _mib(r["compiled"]["temp"]),
                 _mib(r["peak_bytes_in_use"]), _mib(r["resident_bytes"]),
                 _mib(r.get("peak_beyond_params_grads")), f"{r['step_ms']:.2f}",
                 speed(r, "reversible"), speed(r, "baseline"),
                 ",".join(map(str, r.get("async_overlap") or ())) or "-",
                 r["xla_flags"] or "-"))
  return format_table(("case", "layers", "temp MiB", "peak MiB", "resident MiB",
                       "peak-res-grads", "step ms", "vs reversible", "vs baseline",
                       "async overlap", "XLA_FLAGS"), body)


# ----------------------------------------------------------------------------- CLI
def _can_run() -> bool:
  stats = jax.devices()[0].memory_stats()
  return bool(stats) and "peak_bytes_in_use" in stats


def main(argv: Sequence[str] | None = None) -> dict | None:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.reversible_depth",
                               description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--json", metavar="FILE", help="write the figures here")
  ap.add_argument("--smoke", action="store_true", help="tiny widths and depths 2, 4")
  ap.add_argument("--policies", default=",".join(POLICIES),
                  help="comma-separated policy specs (default: %(default)s)")
  ap.add_argument("--variants", default=",".join(VARIANTS),
                  help="PaReprop variants for the real-step rows, of: "
                       f"{', '.join(VARIANTS)} ('' for none; default: all)")
  ap.add_argument("--depths", help="comma-separated layer counts (default 12,24; smoke 2,4)")
  ap.add_argument("--batch", type=int, help="compile-only rows' batch (default 4; smoke 2)")
  ap.add_argument("--run-batch", type=int, help="real steps' batch (default 32; smoke 2)")
  ap.add_argument("--dtype", default="bfloat16", help="compute dtype (default: %(default)s)")
  run = ap.add_mutually_exclusive_group()
  run.add_argument("--run", action="store_true", help="real steps even without a GPU")
  run.add_argument("--compile-only", action="store_true", help="no real steps")
  ap.add_argument("--target", metavar="GPU",
                  help="with --compile-only: compile for this GPU instead of the local "
                       "backend (lowmem_jax.gpu_target: h100; no GPU needed)")
  ap.add_argument("--no-compile-rows", action="store_true",
                  help="skip the compile-only rows (the real-step rows carry compiled memory)")
  ap.add_argument("--steps", type=int, default=10, help="steps per timing round")
  ap.add_argument("--rounds", type=int, default=5, help="timing rounds (median)")
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--case-timeout", type=float, default=240, help="seconds per child")
  ap.add_argument("--child", help=argparse.SUPPRESS)
  ap.add_argument("--child-out", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)

  if args.child:  # one real-step case, in its own process
    Path(args.child_out).write_text(json.dumps(run_case(json.loads(args.child))))
    return None
  # this process starts the backend too (the device's name, the compile-only rows): without
  # preallocating, so the children measured after it get the whole GPU
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

  cli_checks.at_least(ap, args, "--batch", "--run-batch", "--steps", "--rounds")
  cli_checks.at_least(ap, args, "--warmup", minimum=0)
  cli_checks.above(ap, args, "--case-timeout")
  cli_checks.output_file(ap, args, "--json")
  cfg = dict(SMOKE if args.smoke else FULL, dtype=args.dtype)
  if args.depths:
    try:
      cfg["depths"] = tuple(int(d) for d in args.depths.split(","))
    except ValueError:
      ap.error(f"--depths {args.depths!r}: expected comma-separated layer counts, e.g. 12,24")
    if min(cfg["depths"]) < 1 or len(set(cfg["depths"])) < len(cfg["depths"]):
      ap.error(f"--depths {args.depths!r}: layer counts >= 1, each once (the growth is "
               "between the least and the most)")
  cfg["batch"] = args.batch if args.batch is not None else cfg["batch"]
  cfg["run_batch"] = args.run_batch if args.run_batch is not None else cfg["run_batch"]
  try:
    policies = policy_list(args.policies)
  except ValueError as e:
    ap.error(f"--policies: {e}")
  variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  unknown = sorted(set(variants) - set(VARIANTS))
  if unknown:
    ap.error(f"--variants: unknown {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
  if args.target and (not args.compile_only or args.no_compile_rows):
    ap.error("--target goes with --compile-only (and the compile rows)")
  if args.target:  # an unknown name, or no CUDA plugin: one line, before any work
    try:
      gpu_target.device(args.target)
    except (ValueError, gpu_target.TargetUnavailable) as e:
      ap.error(str(e))
  real = args.run or (not args.compile_only and _can_run())
  if not real and args.no_compile_rows:
    ap.error("--no-compile-rows leaves nothing to measure: " + (
        "--compile-only runs no steps (drop one of them)" if args.compile_only else
        f"no real steps on {jax.default_backend()} (pass --run to run them here)"))

  with gpu_target.compiling_for(args.target) as target:
    return _measure(args, cfg, policies, variants, real, target)


def _measure(args, cfg: dict, policies, variants, real: bool, target) -> dict:
  """The compile rows (for ``target`` when given) and the real-step rows; writes the JSON."""
  if target is not None:  # compiled for a GPU that is not here: nothing runs
    where = {"device_kind": target.device_kind, "backend": "gpu",
             "compile_target": target.name}
  else:
    where = {"device_kind": jax.devices()[0].device_kind, "backend": jax.default_backend()}
  result = {**where, "jax_version": jax.__version__, "model": cfg["model"],
            "depths": cfg["depths"],
            "overrides": cfg["overrides"], "dtype": args.dtype, "policies": policies,
            "compile_batch": cfg["batch"], "step": "value_and_grad of the mean "
            "cross-entropy over all parameters (outputs: loss and gradients)"}
  if not args.no_compile_rows:
    rows = []
    for spec in policies:
      for layers in cfg["depths"]:
        rows.append(compile_row(cfg["model"], spec, layers, cfg["batch"],
                                jnp.dtype(args.dtype), cfg["overrides"]))
        print(f"compiled [{spec} x {layers}]: temp {_mib(rows[-1]['compiled']['temp'])} MiB",
              flush=True)
    result["compile_rows"] = rows
    result["compile_growth"] = depth_growth(rows)
    print(f"\nCompiled, not run ({result['backend']}): {cfg['model']}, batch {cfg['batch']}, "
          f"{args.dtype}\n" + compile_table(rows, result["compile_growth"]), flush=True)
  if real:
    result.update(run_batch=cfg["run_batch"], steps=args.steps, rounds=args.rounds,
                  warmup=args.warmup, variants=variants)

    def save(rows):
      write_json(args.json, dict(result, run_rows=rows))

    rows = run_cases(cfg, policies, variants, steps=args.steps, rounds=args.rounds,
                     warmup=args.warmup, timeout_s=args.case_timeout, on_row=save)
    result["run_rows"] = rows
    result["run_growth"] = depth_growth([r for r in rows if r["case"] == r["policy"]])
    print(f"\nReal steps ({result['device_kind']}): {cfg['model']}, batch {cfg['run_batch']}, "
          f"{args.dtype}; a fresh process per row\n" + run_table(rows), flush=True)
  write_json(args.json, result)
  return result


if __name__ == "__main__":
  main()
