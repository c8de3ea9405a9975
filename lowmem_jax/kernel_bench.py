"""Benchmark of the Pallas kernels against the jnp/XLA path, and a block step ratio.

``python -m lowmem_jax.kernel_bench [--json FILE]`` on a GPU: for each kernel (2-bit
pack/unpack, fused approx2 forward/backward, fused MS norm forward/backward) it checks
the Pallas result against the jnp reference on the device, times both (interleaved,
median), and reports achieved GB/s and % of the GPU's memory bandwidth (spec sheet, and
a measured XLA copy as a practical ceiling). Then it times a ViT-B block stack train
step under ``baseline``, ``lowmembp`` (XLA) and ``lowmembp+kernels=pallas``, as ratios
to baseline in the same process. ``--interpret`` runs a tiny smoke version on any
backend (timings then mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowmem_jax import activations, block_stack, norms, packing
from lowmem_jax.memory import format_table, write_json
from lowmem_jax.policy import MemoryPolicy
from pallas_kernels import activations as pallas_activations
from pallas_kernels import norms as pallas_norms
from pallas_kernels import packing as pallas_packing

# Spec-sheet HBM bandwidth, bytes/s, by a substring of jax's device_kind.
SPEC_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L4": 0.3e12}


def spec_bandwidth(device) -> float | None:
  kind = getattr(device, "device_kind", "")
  return next((bw for name, bw in SPEC_BANDWIDTH.items() if name in kind), None)


def time_interleaved(fns: dict[str, Callable], args: dict[str, tuple], rounds: int,
                     warmup: int = 2) -> dict[str, float]:
  """Median seconds per call of each fn, run round-robin so drift hits all alike."""
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


def _max_err(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b))) if a.size else 0.0


def kernel_cases(n: int, hidden: int, dtype, interpret: bool):
  """(name, pallas fn, xla fn, args, bytes moved) for every kernel; the xla fn is the
  jnp path of the same op (the reference)."""
  x = jax.random.normal(jax.random.key(0), (n // hidden, hidden), jnp.float32) * 3
  x = x.astype(dtype)
  g = jax.random.normal(jax.random.key(1), x.shape, jnp.float32).astype(dtype)
  s, rows = jnp.dtype(dtype).itemsize, x.shape[0]
  step = activations.REGELU2
  codes = step.code(x)
  packed = packing.pack_2bit(codes)
  ln_y, ln_rstd = pallas_norms.ms_norm_forward(x, kind="layer", eps=1e-6, interpret=interpret)
  ref_ln = jax.vjp(norms.ms_layer_norm, x)
  p = dict(interpret=interpret)
  cases = [
      ("pack_2bit", jax.jit(functools.partial(pallas_packing.pack_2bit, **p)),
       jax.jit(packing.pack_2bit), (codes,), n + n // 4),
      ("unpack_2bit", jax.jit(lambda b: pallas_packing.unpack_2bit(b, x.shape, **p)),
       jax.jit(lambda b: packing.unpack_2bit(b, x.shape)), (packed,), n // 4 + n),
      ("regelu2_forward",
       jax.jit(lambda x: pallas_activations.approx2_forward(
           x, kind="gelu", thresholds=step.thresholds, **p)),
       jax.jit(lambda x: (activations.gelu(x), packing.pack_2bit(step.code(x)))),
       (x,), 2 * n * s + n // 4),
      ("approx2_backward",
       jax.jit(lambda g, b: pallas_activations.approx2_backward(g, b, levels=step.levels, **p)),
       jax.jit(lambda g, b: (g.astype(jnp.float32) * step.derivative_of_code(
           packing.unpack_2bit(b, g.shape))).astype(g.dtype)),
       (g, packed), 2 * n * s + n // 4),
      ("ms_layer_norm_forward",
       jax.jit(lambda x: pallas_norms.ms_norm_forward(x, kind="layer", eps=1e-6, **p)),
       jax.jit(lambda x: norms.ms_layer_norm(x)), (x,), 2 * n * s + 4 * rows),
      ("ms_layer_norm_backward",
       jax.jit(lambda g, y, r: pallas_norms.ms_norm_backward(g, y, r, kind="layer", **p)),
       jax.jit(lambda g, y, r: ref_ln[1](g)[0]), (g, ln_y, ln_rstd), 3 * n * s + 4 * rows),
  ]
  return cases


def bench_kernels(n, hidden, dtype, rounds, interpret):
  device = jax.devices()[0]
  spec = spec_bandwidth(device)
  copy = jax.jit(lambda a: a + 1)
  big = jnp.zeros((n,), dtype)
  copy_time = time_interleaved({"copy": copy}, {"copy": (big,)}, rounds)["copy"]
  copy_bw = 2 * n * jnp.dtype(dtype).itemsize / copy_time
  rows = []
  for name, pallas_fn, xla_fn, args, nbytes in kernel_cases(n, hidden, dtype, interpret):
    out_p, out_x = pallas_fn(*args), xla_fn(*args)
    errs = [_max_err(a, b) for a, b in zip(jax.tree.leaves(out_p), jax.tree.leaves(out_x))]
    t = time_interleaved({"pallas": pallas_fn, "xla": xla_fn},
                         {"pallas": args, "xla": args}, rounds)
    rows.append({
        "kernel": name, "max_abs_err_vs_xla": max(errs), "bytes": nbytes,
        "pallas_us": t["pallas"] * 1e6, "xla_us": t["xla"] * 1e6,
        "pallas_GBps": nbytes / t["pallas"] / 1e9, "xla_GBps": nbytes / t["xla"] / 1e9,
        "pallas_pct_spec": None if spec is None else 100 * nbytes / t["pallas"] / spec,
        "pallas_pct_copy": 100 * nbytes / t["pallas"] / copy_bw,
        "speedup_vs_xla": t["xla"] / t["pallas"],
    })
  return {"device": device.device_kind, "spec_bandwidth_Bps": spec,
          "measured_copy_Bps": copy_bw, "n": n, "hidden": hidden,
          "dtype": jnp.dtype(dtype).name, "rows": rows}


def bench_block_step(cfg, batch, seq, dtype, rounds, policies):
  x = jax.random.normal(jax.random.key(0), (batch, seq, cfg.dim), jnp.float32).astype(dtype)
  fns, args = {}, {}
  for spec in policies:
    policy = MemoryPolicy.parse(spec)
    params = block_stack.init_stack(jax.random.key(0), cfg, policy)
    fns[spec] = jax.jit(functools.partial(block_stack.sgd_step, cfg=cfg, policy=policy))
    args[spec] = (params, x)
  t = time_interleaved(fns, args, rounds)
  base = t[policies[0]]
  return [{"policy": spec, "step_ms": t[spec] * 1e3, "ratio_vs_baseline": base / t[spec]}
          for spec in policies]


def main(argv: Sequence[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(prog="python -m lowmem_jax.kernel_bench", description=__doc__)
  ap.add_argument("--elements", type=int, default=64 * 197 * 3072)
  ap.add_argument("--hidden", type=int, default=3072)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--rounds", type=int, default=50)
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--interpret", action="store_true",
                  help="tiny sizes, kernels in interpret mode (smoke test on any backend)")
  ap.add_argument("--json", metavar="FILE")
  args = ap.parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  cfg = block_stack.StackConfig(num_layers=args.layers)
  seq, batch = 197, args.batch
  policies = ["baseline", "lowmembp+kernels=xla", "lowmembp+kernels=pallas"]
  if args.interpret:
    args.elements, args.hidden, args.rounds = 4096, 64, 2
    cfg = block_stack.StackConfig(num_layers=1, dim=32, num_heads=4, mlp_dim=64)
    seq, batch = 8, 2
    policies = ["baseline", "lowmembp+kernels=xla", "lowmembp+kernels=pallas_interpret"]
  kernels = bench_kernels(args.elements, args.hidden, dtype, args.rounds, args.interpret)
  step = bench_block_step(cfg, batch, seq, dtype, max(args.rounds // 5, 2), policies)

  print(f"device: {kernels['device']}  backend: {jax.default_backend()}  jax {jax.__version__}")
  print(f"{args.elements} elements, hidden {args.hidden}, {dtype.name}; measured XLA copy "
        f"{kernels['measured_copy_Bps'] / 1e9:.0f} GB/s; spec "
        + ("-" if kernels["spec_bandwidth_Bps"] is None
           else f"{kernels['spec_bandwidth_Bps'] / 1e9:.0f} GB/s"))
  print(format_table(
      ("kernel", "max err", "pallas us", "xla us", "pallas GB/s", "% spec", "% copy",
       "speedup"),
      [(r["kernel"], f"{r['max_abs_err_vs_xla']:.2e}", f"{r['pallas_us']:.1f}",
        f"{r['xla_us']:.1f}", f"{r['pallas_GBps']:.0f}",
        "-" if r["pallas_pct_spec"] is None else f"{r['pallas_pct_spec']:.0f}",
        f"{r['pallas_pct_copy']:.0f}", f"{r['speedup_vs_xla']:.2f}")
       for r in kernels["rows"]]))
  print(f"\ntrain step, {cfg.kind} block stack: {cfg.num_layers} layers, D={cfg.dim}, "
        f"batch {batch}, seq {seq}")
  print(format_table(("policy", "step ms", "speed vs baseline"),
                     [(r["policy"], f"{r['step_ms']:.2f}", f"{r['ratio_vs_baseline']:.3f}")
                      for r in step]))
  result = {"jax_version": jax.__version__, "backend": jax.default_backend(),
            "interpret": args.interpret, "kernels": kernels, "block_step": step}
  write_json(args.json, result)
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
