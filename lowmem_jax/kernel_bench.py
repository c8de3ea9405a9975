"""Benchmark of the Pallas kernels against the jnp/XLA path, and a block step ratio.

``python -m lowmem_jax.kernel_bench [--json FILE]`` on a GPU. Kernels are timed on the
device, not by a host clock around one call: each op runs ``iters`` times inside one
jitted program (:func:`looped`), and the program's time is divided by ``iters``.
First the bench measures an XLA copy (``a + 1``: bytes read + written / time) and
compares it with the device's HBM bandwidth (:data:`PEAK_BANDWIDTH`); a copy below
:data:`COPY_FLAG_FRACTION` of it is flagged LOW, in the printout and the JSON, because the
timings then measure overhead rather than memory traffic (above the peak: ABOVE PEAK,
calls were dropped; a kernel row above it says its data stayed in L2). Then for each kernel (2-bit
pack/unpack, fused approx2 forward/backward, fused MS norm forward/backward) it checks
the Pallas result against the jnp reference, times both (interleaved, median), and
reports GB/s (bytes read + written), % of peak and % of the measured copy. Last, a
ViT-B block stack train step under ``baseline``, ``lowmembp`` (XLA) and
``lowmembp+kernels=pallas``, as speed ratios to baseline (steps are milliseconds long:
a host clock is fine there). ``--interpret`` runs a tiny smoke version on any backend
(timings then mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowmem_jax import activations, block_stack, cli_checks, norms, packing
from lowmem_jax.memory import error_line, format_table, write_json
from lowmem_jax.policy import MemoryPolicy

# HBM bandwidth from the spec sheets, bytes/s, by a substring of jax's device_kind;
# the first match wins (so "H100 PCIe" before "H100"). Unknown device: no flag.
PEAK_BANDWIDTH = (
    ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12),  # "H100 80GB HBM3": SXM
    ("H200", 4.8e12), ("GH200", 4.0e12),
    ("A100-SXM4-40GB", 1.555e12), ("A100-PCIE-40GB", 1.555e12), ("A100", 2.039e12),
    ("L40S", 0.864e12), ("L4", 0.3e12),
)
# A measured copy below this fraction of the peak: the timings are not kernel times.
COPY_FLAG_FRACTION = 0.6
# Above this fraction of the peak a figure is not HBM traffic: calls were dropped, or the
# working set stayed in L2 (50 MB on an H100; pack/unpack at the default size: ~48 MB).
ABOVE_PEAK_FRACTION = 1.1


def spec_bandwidth(device) -> float | None:
  """The device's HBM bandwidth in bytes/s from :data:`PEAK_BANDWIDTH`, or None."""
  kind = getattr(device, "device_kind", "")
  return next((bw for name, bw in PEAK_BANDWIDTH if name in kind), None)


def time_interleaved(fns: dict[str, Callable], args: dict[str, tuple], rounds: int,
                     warmup: int = 2) -> dict[str, float]:
  """Median host seconds per call of each fn, run round-robin so drift hits all alike.
  For calls of many milliseconds (train steps); kernels use :func:`device_seconds`."""
  for name, fn in fns.items():
    for _ in range(warmup):
      jax.block_until_ready(fn(*args[name]))
  times = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args[name]))
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


# ----------------------------------------------------------------------------- device timing
# XLA:GPU may unroll a loop of up to 64 trips, and then the check cannot see the loop: a
# GPU timing loop runs at least this many calls (XLA:CPU keeps any loop)
MIN_LOOP_TRIPS = 65


def looped(fn: Callable, iters: int):
  """``jit`` of a program that calls ``fn(*args)`` ``iters`` times and returns the last
  outputs.

  Each iteration passes the inputs and the previous outputs through one
  ``lax.optimization_barrier``, so to XLA every call's inputs depend on the call before:
  it can neither hoist the call out of the loop nor merge calls (on the GPU the barrier
  is only removed after scheduling). The trip count is static, so XLA knows it and the
  GPU runs the loop without reading a predicate back each iteration; what remains per
  call is the loop counter's tiny kernel (a few us on a GPU: a few % at the default
  sizes). Not unrolled: once the barriers are gone, calls within one trip would be
  identical and dead but for the last, and XLA could merge or drop them.
  """
  def run(*args):
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args))

    def body(_, carry):
      inputs, _ = lax.optimization_barrier(carry)
      return inputs, fn(*inputs)

    return lax.fori_loop(0, iters, body, (args, init))[1]

  return jax.jit(run)


def _computation(hlo: str, name: str) -> str:
  """The text of computation ``name`` in an HLO module dump ("" when absent)."""
  m = re.search(r"^(?:ENTRY )?%?" + re.escape(name) + r" [^\n]*\{\n(.*?)^\}", hlo,
                re.S | re.M)
  return m.group(1) if m else ""


def _reachable(hlo: str, name: str) -> str:
  """Computation ``name`` and every computation it calls (fusions, command buffers)."""
  seen, todo, texts = set(), [name], []
  while todo:
    current = todo.pop()
    if current in seen:
      continue
    seen.add(current)
    text = _computation(hlo, current)
    texts.append(text)
    for group in re.findall(r"(?:calls|to_apply|body|branch_computations|"
                            r"called_computations)=\{?([%\w.\-, ]+)\}?", text):
      todo += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
  return "\n".join(texts)


# An instruction that computes an array (not the scalar loop counter): a fusion, a custom
# call (Pallas) or a bare op (XLA:CPU leaves single ops unfused when its fusion emitters
# are off), also inside a called computation (XLA:GPU command buffers); not one that only
# moves or names what the loop carries, or calls a computation (searched in its turn).
_ARRAY_OP = re.compile(r"= (\([^=]*?\)|[a-z]\w*\[\d[\d,]*\]\S*) ([a-z][\w\-]*)\(")
_BOOKKEEPING = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "copy",
                "copy-start", "copy-done", "opt-barrier", "call", "while", "conditional"}


def loop_intact(hlo: str, iters: int) -> bool:
  """Whether a compiled :func:`looped` program still runs the op ``iters`` times: a
  while loop with that known trip count whose body (or what it calls) holds real work,
  a fusion or custom call producing an array, not only the loop counter."""
  for m in re.finditer(r"while\([^\n]*body=%?([\w.\-]+)[^\n]*", hlo):
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', m.group(0))
    if trip is None or int(trip.group(1)) != iters:
      continue
    for op in _ARRAY_OP.finditer(_reachable(hlo, m.group(1))):
      # an array shape (a tuple may hold several)
      if op.group(2) not in _BOOKKEEPING and re.search(r"\[\d", op.group(1)):
        return True
  return False


def device_seconds(fns: dict[str, Callable], args: dict[str, tuple], *, target_s: float,
                   rounds: int, min_iters: int = 2,
                   max_iters: int = 100_000) -> dict[str, dict]:
  """Seconds per call of each fn, timed on the device: ``{name: {"seconds", "iters",
  "loop_intact"}}``.

  ``iters`` is picked so one looped program runs about ``target_s`` (from a host-timed
  single call, which overstates the time: the loop then runs a bit shorter), within
  ``[min_iters, max_iters]``; the looped programs run round-robin ``rounds`` times,
  median, divided by ``iters``.
  """
  progs, out = {}, {}
  for name, fn in fns.items():
    single = jax.jit(fn)
    jax.block_until_ready(single(*args[name]))
    t = []
    for _ in range(3):
      start = time.perf_counter()
      jax.block_until_ready(single(*args[name]))
      t.append(time.perf_counter() - start)
    iters = math.ceil(target_s / max(min(t), 1e-9))
    iters = int(min(max(iters, min_iters, 2), max_iters))
    compiled = looped(fn, iters).lower(*args[name]).compile()
    progs[name] = compiled
    out[name] = {"iters": iters, "loop_intact": loop_intact(compiled.as_text(), iters)}
  seconds = time_interleaved(progs, args, rounds, warmup=1)
  for name in fns:
    out[name]["seconds"] = seconds[name] / out[name]["iters"]
  return out


def measure_copy(n: int, dtype, *, target_s: float, rounds: int, device=None,
                 **iters) -> dict:
  """Bandwidth of an XLA elementwise copy (``a + 1`` over ``n`` elements): bytes read +
  written / device time, against the device's peak; ``low`` flags a copy below
  ``COPY_FLAG_FRACTION`` of the peak, ``above_peak`` one above ``ABOVE_PEAK_FRACTION``
  of it (None: peak unknown)."""
  device = jax.devices()[0] if device is None else device
  a = jnp.zeros((n,), dtype)
  timing = device_seconds({"copy": lambda a: a + 1}, {"copy": (a,)}, target_s=target_s,
                          rounds=rounds, **iters)["copy"]
  nbytes = 2 * n * jnp.dtype(dtype).itemsize
  bps = nbytes / timing["seconds"]
  peak = spec_bandwidth(device)
  return {"op": "a + 1", "bytes": nbytes, "seconds": timing["seconds"],
          "iters": timing["iters"], "loop_intact": timing["loop_intact"], "Bps": bps,
          "peak_Bps": peak, "pct_peak": None if peak is None else 100 * bps / peak,
          "low": None if peak is None else bps < COPY_FLAG_FRACTION * peak,
          "above_peak": _above_peak(bps, peak)}


def _above_peak(bps: float, peak: float | None) -> bool | None:
  return None if peak is None else bps > ABOVE_PEAK_FRACTION * peak


def copy_line(copy: dict, device_kind: str) -> str:
  """One line saying the measured copy bandwidth, and whether it is flagged."""
  text = (f"measured copy ({copy['op']}, bytes read + written): {copy['Bps'] / 1e9:.0f} GB/s")
  if copy["peak_Bps"] is None:
    return text + f"; peak of {device_kind!r} unknown: not checked"
  text += f" = {copy['pct_peak']:.0f}% of the {copy['peak_Bps'] / 1e9:.0f} GB/s peak"
  if copy["low"]:
    text += (f"  LOW (< {100 * COPY_FLAG_FRACTION:.0f}%): the timings below measure "
             "overhead, not memory traffic; do not trust their GB/s")
  if copy["above_peak"]:
    text += "  ABOVE PEAK: calls were dropped from the loop; do not trust the timings"
  return text


# ----------------------------------------------------------------------------- kernels
def _max_err(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b))) if a.size else 0.0


def kernel_cases(n: int, hidden: int, dtype, interpret: bool):
  """(name, pallas fn, xla fn, args, bytes read + written) for every kernel; the xla fn
  is the kernel's jnp reference (same name in ``lowmem_jax``, same arguments)."""
  from lowmem_jax import quant
  from pallas_kernels import activations as pallas_activations
  from pallas_kernels import packing as pallas_packing
  from pallas_kernels import quant as pallas_quant

  x = jax.random.normal(jax.random.key(0), (n // hidden, hidden), jnp.float32) * 3
  x = x.astype(dtype)
  g = jax.random.normal(jax.random.key(1), x.shape, jnp.float32).astype(dtype)
  s, rows, n = jnp.dtype(dtype).itemsize, x.shape[0], x.size
  codes = activations.REGELU2.code(x)
  packed = packing.pack_2bit(codes)
  x3 = x.reshape(rows, 1, hidden)  # Mesa's [O, G, I] view: one group, coded per row
  lo, hi = quant.batch_range(x3, axis=1)
  seed = jnp.uint32(7)
  mesa_codes = quant.quantize_reference(x3, lo, hi, seed)
  p = dict(interpret=interpret)
  return [
      ("pack_2bit", functools.partial(pallas_packing.pack_2bit, **p), packing.pack_2bit,
       (codes,), n + n // 4),
      ("unpack_2bit", lambda b: pallas_packing.unpack_2bit(b, x.shape, **p),
       lambda b: packing.unpack_2bit(b, x.shape), (packed,), n // 4 + n),
      ("regelu2_forward",
       functools.partial(pallas_activations.approx2_forward, "gelu", **p),
       functools.partial(activations.approx2_forward, "gelu"), (x,), 2 * n * s + n // 4),
      ("approx2_backward",
       functools.partial(pallas_activations.approx2_backward, "gelu", **p),
       functools.partial(activations.approx2_backward, "gelu"),
       (g, packed), 2 * n * s + n // 4),
      *_norm_cases("layer", x, g, p, 2 * n * s + 4 * rows),
      ("resilu2_forward",
       functools.partial(pallas_activations.approx2_forward, "silu", **p),
       functools.partial(activations.approx2_forward, "silu"), (x,), 2 * n * s + n // 4),
      *_norm_cases("rms", x, g, p, 2 * n * s + 4 * rows),
      # Mesa's 8-bit codes: the same codes and values as the reference, bit for bit
      ("mesa_quantize", lambda x3, lo, hi: pallas_quant.quantize(x3, lo, hi, seed, **p),
       lambda x3, lo, hi: quant.quantize_reference(x3, lo, hi, seed), (x3, lo, hi),
       n * s + n),
      ("mesa_dequantize",
       lambda c, lo, hi: pallas_quant.dequantize(c, lo, hi, dtype, **p),
       lambda c, lo, hi: quant.dequantize_reference(c, lo, hi, dtype), (mesa_codes, lo, hi),
       n + n * s),
  ]


def _norm_cases(kind: str, x, g, p: dict, forward_bytes: int) -> list[tuple]:
  """:func:`kernel_cases`' rows of one MS norm: forward, and backward at its outputs
  (which read g as well: ``forward_bytes`` plus one more x-sized array)."""
  from pallas_kernels import norms as pallas_norms
  y, rstd = norms.ms_norm_forward(kind, x, 1e-6)
  return [
      (f"ms_{kind}_norm_forward",
       lambda x: pallas_norms.ms_norm_forward(kind, x, 1e-6, **p),
       lambda x: norms.ms_norm_forward(kind, x, 1e-6), (x,), forward_bytes),
      (f"ms_{kind}_norm_backward",
       functools.partial(pallas_norms.ms_norm_input_grad, kind, **p),
       functools.partial(norms.ms_norm_input_grad, kind),
       (g, y, rstd), forward_bytes + x.nbytes)]


def bench_kernels(n, hidden, dtype, rounds, interpret, target_s=0.025, min_iters=2,
                  max_iters=100_000):
  """The copy check, then each kernel's error vs its reference and device-timed GB/s."""
  device = jax.devices()[0]
  iters = dict(min_iters=min_iters, max_iters=max_iters)
  copy = measure_copy(n, dtype, target_s=target_s, rounds=rounds, device=device, **iters)
  print(copy_line(copy, device.device_kind), flush=True)  # before any kernel's GB/s
  peak, rows = copy["peak_Bps"], []
  for name, pallas_fn, xla_fn, args, nbytes in kernel_cases(n, hidden, dtype, interpret):
    try:  # a kernel that fails to compile or run is a row with its error, not the end
      out_p, out_x = jax.jit(pallas_fn)(*args), jax.jit(xla_fn)(*args)
      errs = [_max_err(a, b) for a, b in zip(jax.tree.leaves(out_p), jax.tree.leaves(out_x),
                                             strict=True)]
      t = device_seconds({"pallas": pallas_fn, "xla": xla_fn}, {"pallas": args, "xla": args},
                         target_s=target_s, rounds=rounds, **iters)
    except Exception as e:  # noqa: BLE001 - reported in the row, and the bench goes on
      rows.append({"kernel": name, "error": error_line(e)})
      print(f"{name}: failed: {rows[-1]['error']}", flush=True)
      continue
    tp, tx = t["pallas"]["seconds"], t["xla"]["seconds"]
    rows.append({
        "kernel": name, "max_abs_err_vs_xla": max(errs), "bytes": nbytes,
        "pallas_us": tp * 1e6, "xla_us": tx * 1e6,
        "pallas_GBps": nbytes / tp / 1e9, "xla_GBps": nbytes / tx / 1e9,
        "pallas_pct_spec": None if peak is None else 100 * nbytes / tp / peak,
        "pallas_pct_copy": 100 * nbytes / tp / copy["Bps"],
        "speedup_vs_xla": tx / tp,
        "pallas_iters": t["pallas"]["iters"], "xla_iters": t["xla"]["iters"],
        "loop_intact": t["pallas"]["loop_intact"] and t["xla"]["loop_intact"],
        "copy_low": copy["low"],
        "above_peak": _above_peak(nbytes / min(tp, tx), peak),
    })
  return {"device": device.device_kind, "spec_bandwidth_Bps": peak,
          "measured_copy_Bps": copy["Bps"], "copy": copy, "copy_low": copy["low"],
          "timing": "device: many calls in one jitted program (lax.fori_loop) / iters",
          "n": n, "hidden": hidden, "dtype": jnp.dtype(dtype).name, "rows": rows}


def kernel_table(kernels: dict) -> str:
  """The kernel table; its first row is the copy check, with its flag."""
  copy = kernels["copy"]
  flag = "-" if copy["low"] is None else (
      "LOW" if copy["low"] else "ABOVE PEAK" if copy["above_peak"] else "ok")
  pct = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
  rows = [("copy (XLA a+1)", "-", "-", f"{copy['seconds'] * 1e6:.1f}", "-",
           f"{copy['Bps'] / 1e9:.0f}", pct(copy["pct_peak"]), "100", "-", flag)]
  for r in kernels["rows"]:
    if "error" in r:
      rows.append((r["kernel"], "-", "-", "-", "-", "-", "-", "-", "-", "failed"))
      continue
    note = ("LOW copy" if r["copy_low"] else "loop?" if not r["loop_intact"]
            else "above peak" if r["above_peak"] else "ok")
    rows.append((r["kernel"], f"{r['max_abs_err_vs_xla']:.2e}", f"{r['pallas_us']:.1f}",
                 f"{r['xla_us']:.1f}", f"{r['pallas_GBps']:.0f}", f"{r['xla_GBps']:.0f}",
                 pct(r["pallas_pct_spec"]), f"{r['pallas_pct_copy']:.0f}",
                 f"{r['speedup_vs_xla']:.2f}", note))
  return format_table(("kernel", "max err", "pallas us", "xla us", "pallas GB/s",
                       "xla GB/s", "% peak", "% copy", "speedup", "flag"), rows)


# ----------------------------------------------------------------------------- block step
def bench_block_step(cfg, batch, seq, dtype, rounds, policies):
  """Step time of each policy (host clock, interleaved) and its speed ratio to the
  first; a policy that fails to compile or run is recorded with its error."""
  x = jax.random.normal(jax.random.key(0), (batch, seq, cfg.dim), jnp.float32).astype(dtype)
  fns, args, errors = {}, {}, {}
  for spec in policies:
    try:
      policy = MemoryPolicy.parse(spec)
      params = block_stack.init_stack(jax.random.key(0), cfg, policy)
      fn = jax.jit(functools.partial(block_stack.sgd_step, cfg=cfg, policy=policy))
      jax.block_until_ready(fn(params, x))
      fns[spec], args[spec] = fn, (params, x)
    except Exception as e:  # noqa: BLE001  (report the rest; a crash names its policy)
      errors[spec] = error_line(e)
      print(f"block step [{spec}] failed: {errors[spec]}", file=sys.stderr, flush=True)
  t = time_interleaved(fns, args, rounds) if fns else {}
  base = t.get(policies[0])
  rows = []
  for spec in policies:
    if spec in errors:
      rows.append({"policy": spec, "error": errors[spec]})
    else:
      rows.append({"policy": spec, "step_ms": t[spec] * 1e3,
                   "ratio_vs_baseline": None if base is None else base / t[spec]})
  return rows


def _step_table(step) -> str:
  def cells(r):
    if "error" in r:
      return (r["policy"], "error", r["error"][:60])
    ratio = r["ratio_vs_baseline"]
    return (r["policy"], f"{r['step_ms']:.2f}", "-" if ratio is None else f"{ratio:.3f}")
  return format_table(("policy", "step ms", "speed vs baseline"), [cells(r) for r in step])


def main(argv: Sequence[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(prog="python -m lowmem_jax.kernel_bench", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--elements", type=int, default=64 * 197 * 3072)
  ap.add_argument("--hidden", type=int, default=3072)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--rounds", type=int, default=5,
                  help="timed runs of each looped kernel program (median)")
  ap.add_argument("--target-ms", type=float, default=25.0,
                  help="about how long one looped kernel program runs")
  ap.add_argument("--step-rounds", type=int, default=10, help="timed block steps per policy")
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--no-step", action="store_true", help="kernels only, no block step")
  ap.add_argument("--interpret", action="store_true",
                  help="kernels in interpret mode, at fixed tiny sizes (4096 elements, hidden "
                       "64, 1 layer of width 32, batch 2, 2 rounds: the size and round flags "
                       "are not read): a smoke test on any backend")
  ap.add_argument("--json", metavar="FILE")
  args = ap.parse_args(argv)
  cli_checks.at_least(ap, args, "--elements", "--hidden", "--rounds", "--step-rounds",
                      "--layers", "--batch")
  cli_checks.above(ap, args, "--target-ms")
  cli_checks.output_file(ap, args, "--json")
  try:
    dtype = jnp.dtype(args.dtype)
  except TypeError:
    ap.error(f"--dtype {args.dtype!r} is not a dtype; e.g. bfloat16, float16, float32")
  if not jnp.issubdtype(dtype, jnp.floating):
    ap.error(f"--dtype {args.dtype!r} is not a floating dtype")
  if not args.interpret and args.elements < args.hidden:
    ap.error(f"--elements {args.elements} is less than one row of --hidden {args.hidden}")
  if not args.interpret and jax.default_backend() != "gpu":  # each kernel a failed row
    ap.error(f"the kernels compile for a GPU, and this backend is {jax.default_backend()}: "
             "pass --interpret for the smoke version")
  cfg = block_stack.StackConfig(num_layers=args.layers)
  # a ~50 us kernel gets ~500 calls from --target-ms anyway
  seq, batch, min_iters, max_iters = 197, args.batch, MIN_LOOP_TRIPS, 100_000
  policies = ["baseline", "lowmembp+kernels=xla", "lowmembp+kernels=pallas"]
  if args.interpret:
    args.elements, args.hidden, args.rounds, args.step_rounds = 4096, 64, 2, 2
    args.target_ms = 1.0
    min_iters = 2 if jax.default_backend() == "cpu" else MIN_LOOP_TRIPS
    max_iters = min_iters + 1
    cfg = block_stack.StackConfig(num_layers=1, dim=32, num_heads=4, mlp_dim=64)
    seq, batch = 8, 2
    policies = ["baseline", "lowmembp+kernels=xla", "lowmembp+kernels=pallas_interpret"]
  print(f"device: {jax.devices()[0].device_kind}  backend: {jax.default_backend()}  "
        f"jax {jax.__version__}", flush=True)
  kernels = bench_kernels(args.elements, args.hidden, dtype, args.rounds, args.interpret,
                          target_s=args.target_ms / 1e3, min_iters=min_iters,
                          max_iters=max_iters)
  print(f"{args.elements} elements, hidden {args.hidden}, {dtype.name}; device-timed: "
        "many calls in one jitted program / iters; GB/s = bytes read + written / time")
  print(kernel_table(kernels), flush=True)
  result = {"jax_version": jax.__version__, "backend": jax.default_backend(),
            "interpret": args.interpret, "kernels": kernels, "block_step": []}
  write_json(args.json, result, announce=False)  # kept should the block step be cut short
  if not args.no_step:
    step = bench_block_step(cfg, batch, seq, dtype, args.step_rounds, policies)
    print(f"\ntrain step, {cfg.kind} block stack: {cfg.num_layers} layers, D={cfg.dim}, "
          f"batch {batch}, seq {seq} (host clock, median of {args.step_rounds})")
    print(_step_table(step))
    result["block_step"] = step
  write_json(args.json, result)
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
