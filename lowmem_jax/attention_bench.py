"""Attention implementations timed forward + backward, to derive ``AUTO_GPU_TABLE``.

``python -m lowmem_jax.attention_bench [--json FILE]`` on a GPU: for ViT-B-like
(12 heads, head dim 64, not causal) and LLaMA-like (32 heads, head dim 128, causal)
bf16 attention at N = 17, 64, 129, 197, 577, 1024, 2048 (about 16k / 8k tokens per call), it
times each applicable implementation of :func:`lowmem_jax.attention.attention`
(``cudnn``, ``cudnn_padded`` where N is odd, ``flash``, ``xla``) and prints a table:
ms per forward + backward, the compiled temp memory, what ``auto`` picks now and the
fastest path that keeps no N x N array. Where they differ, edit ``AUTO_GPU_TABLE``.

Timing is on the device: ``count`` forward + backward calls run inside one jitted
``fori_loop`` whose carry feeds each call's gradients and output into the next call's
inputs (nothing can be hoisted or dropped), and the time per call is the difference of
two counts' wall times over the difference of the counts (launch cost cancels).
Where ``cudnn_refusal`` refuses a sequence length, the ``cudnn`` row also runs jax's own
cuDNN call unchecked ("jax unchecked": raises, or runs and the rule is stricter than this
jax/cuDNN needs). Programs compile in parallel threads; rows not started within
``--budget`` seconds are reported as skipped. On a non-GPU backend (or ``--smoke``) it
runs a tiny version: a smoke test, its timings mean nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import sys
import time

import jax
import jax.numpy as jnp

from lowmem_jax import attention as attn
from lowmem_jax import cli_checks
from lowmem_jax.memory import error_line, format_table, write_json

LENGTHS = (17, 64, 129, 197, 577, 1024, 2048)
IMPLEMENTATIONS = ("cudnn", "cudnn_padded", "flash", "xla")
# tokens: batch = max(1, tokens // N), so every length does a comparable amount of work.
MODELS = {
    "vit-b": dict(heads=12, kv_heads=12, head_dim=64, causal=False, tokens=16384),
    "llama": dict(heads=32, kv_heads=32, head_dim=128, causal=True, tokens=8192),
}
SMOKE_MODELS = {
    "vit-b": dict(heads=2, kv_heads=2, head_dim=8, causal=False, tokens=64),
    "llama": dict(heads=4, kv_heads=2, head_dim=8, causal=True, tokens=64),
}
SMOKE_LENGTHS = (17, 32)
TARGET_SECONDS = 0.05   # wall time of the longer of the two timed loops, roughly
BUDGET_SECONDS = 90.0   # rows not started by then are skipped (gpu_check allows 120 s)


def _loop(implementation, causal, count, q, k, v, cotangent):
  """``count`` forward + backward calls; each call's output and grads feed the next."""
  if implementation == "cudnn_unchecked":  # jax's own cuDNN call, past our refusal
    f = functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                          implementation="cudnn")
  else:
    f = functools.partial(attn.attention, causal=causal, implementation=implementation)

  def body(_, carry):
    q, k, v = carry
    o, vjp = jax.vjp(f, q, k, v)
    dq, dk, dv = vjp(cotangent)
    eps = jnp.asarray(1e-3, q.dtype)
    return q + eps * (dq + o), k + eps * dk, v + eps * dv

  return jax.lax.fori_loop(0, count, body, (q, k, v))


def _inputs(model: dict, n: int, dtype):
  b = max(1, model["tokens"] // n)
  h, kh, d = model["heads"], model["kv_heads"], model["head_dim"]
  keys = jax.random.split(jax.random.key(n), 4)
  q = jax.random.normal(keys[0], (b, n, h, d), dtype)
  k = jax.random.normal(keys[1], (b, n, kh, d), dtype)
  v = jax.random.normal(keys[2], (b, n, kh, d), dtype)
  cotangent = jax.random.normal(keys[3], q.shape, dtype)
  return q, k, v, cotangent


def _seconds(run, count: int, repeats: int) -> float:
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(run(count))
    best = min(best, time.perf_counter() - start)
  return best


def time_per_call(run, smoke: bool) -> float:
  """Seconds per call of ``run(count)``'s loop body: (t(c1 + k) - t(c1)) / k."""
  jax.block_until_ready(run(1))  # warm-up (first run, allocation)
  base = 2
  t_base = _seconds(run, base, 1 if smoke else 3)
  extra = 2 if smoke else int(min(max(TARGET_SECONDS / max(t_base / base, 1e-7), 5), 500))
  t_more = _seconds(run, base + extra, 1 if smoke else 3)
  return max(t_more - t_base, 0.0) / extra


def _case(model_name, model, n, implementation, dtype, backend, versions):
  shape_q = (1, n, model["heads"], model["head_dim"])
  shape_k = (1, n, model["kv_heads"], model["head_dim"])
  row = dict(model=model_name, n=n, batch=max(1, model["tokens"] // n),
             heads=model["heads"], kv_heads=model["kv_heads"], head_dim=model["head_dim"],
             causal=model["causal"], dtype=jnp.dtype(dtype).name,
             implementation=implementation, status="ok", ms=None, temp_bytes=None,
             reason="", jax_unchecked=None)
  if implementation in ("cudnn", "cudnn_padded"):
    reason = attn.cudnn_refusal(shape_q, shape_k, dtype, backend=backend,
                                padded=implementation == "cudnn_padded", **versions)
    if implementation == "cudnn_padded" and reason is None and n == attn.padded_length(n):
      reason = f"N {n} needs no padding (same as cudnn)"
    if reason is not None:
      row.update(status="refused", reason=reason)
  return row


def _probe_jax(row) -> bool:
  """Whether to run jax's cuDNN call on a shape our rule refuses: on a CUDA GPU, for a
  shape reason (is the rule still needed on this jax/cuDNN?)."""
  return (row["implementation"] == "cudnn" and row["status"] == "refused"
          and "sequence length" in row["reason"])


def _compile(row, dtype):
  """The row's loop, lowered and compiled (thread-safe part: XLA compile)."""
  model = dict(heads=row["heads"], kv_heads=row["kv_heads"], head_dim=row["head_dim"],
               tokens=row["batch"] * row["n"])
  args = _inputs(model, row["n"], dtype)
  impl = "cudnn_unchecked" if _probe_jax(row) else row["implementation"]
  fn = jax.jit(functools.partial(_loop, impl, row["causal"]))
  lowered = fn.lower(jnp.int32(1), *args)
  return lowered, args


def run_bench(models: dict, lengths, dtype, smoke: bool,
              budget_s: float = BUDGET_SECONDS) -> list[dict]:
  deadline = time.perf_counter() + budget_s
  backend = jax.default_backend()
  versions = dict(cudnn_version=attn.cudnn_version(),
                  compute_capability=attn.compute_capability())
  rows = [_case(name, model, n, impl, dtype, backend, versions)
          for name, model in models.items() for n in lengths for impl in IMPLEMENTATIONS]
  lowered = {}

  def failed(row, e):  # a refusal or a crash is a result
    if row["status"] == "refused":
      row["jax_unchecked"] = f"raises {error_line(e)}"
    else:
      row.update(status="error", reason=error_line(e))

  def out_of_time(row):
    if time.perf_counter() < deadline:
      return False
    if row["status"] == "refused":
      row["jax_unchecked"] = "not run: time budget spent"
    else:
      row.update(status="skipped", reason=f"time budget {budget_s:.0f} s spent")
    return True

  for i, row in enumerate(rows):  # tracing holds the GIL: one at a time
    if (row["status"] == "ok" or _probe_jax(row)) and not out_of_time(row):
      try:
        lowered[i] = _compile(row, dtype)
      except Exception as e:
        failed(row, e)
  # all compiled before any timing, within the budget: a program still compiling at the
  # deadline is skipped (its thread is left to finish; the rows already timed are kept)
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)
  futures = {i: pool.submit(low.compile) for i, (low, _) in lowered.items()}
  concurrent.futures.wait(futures.values(), timeout=max(deadline - time.perf_counter(), 0))
  pool.shutdown(wait=False, cancel_futures=True)
  for i, future in futures.items():
    row = rows[i]
    if not future.done() or future.cancelled():
      row.update(status="skipped", reason=f"time budget {budget_s:.0f} s spent compiling")
      continue
    if out_of_time(row):
      continue
    try:
      compiled = future.result()
      args = lowered[i][1]
      try:
        row["temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
      except Exception:  # not every backend reports it
        pass
      run = lambda count, compiled=compiled, args=args: compiled(jnp.int32(count), *args)
      row["ms"] = time_per_call(run, smoke) * 1e3
      if row["status"] == "refused":
        row["jax_unchecked"] = "runs: cudnn_refusal may be stricter than needed here"
    except Exception as e:
      failed(row, e)
    del lowered[i]
  for name, model in models.items():
    for n in lengths:
      case = [r for r in rows if r["model"] == name and r["n"] == n]
      q_shape = (1, n, model["heads"], model["head_dim"])
      k_shape = (1, n, model["kv_heads"], model["head_dim"])
      auto = attn.choose_implementation(q_shape, k_shape, dtype, backend=backend,
                                        causal=model["causal"], **versions)
      timed = [r for r in case if r["status"] == "ok" and r["implementation"] != "xla"]
      fastest = min(timed, key=lambda r: r["ms"])["implementation"] if timed else None
      for r in case:
        r.update(auto=auto.implementation, fastest_no_nxn=fastest)
  return rows


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(prog="python -m lowmem_jax.attention_bench",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--json", metavar="FILE", help="write the rows as JSON")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny shapes, timings meaningless (default off GPU)")
  ap.add_argument("--lengths", help=f"comma-separated N (default {LENGTHS})")
  ap.add_argument("--models", help=f"comma-separated subset of {', '.join(MODELS)}")
  ap.add_argument("--budget", type=float, default=BUDGET_SECONDS,
                  help="seconds; rows not started by then are reported as skipped")
  args = ap.parse_args(argv)
  cli_checks.above(ap, args, "--budget")
  cli_checks.output_file(ap, args, "--json")
  smoke = args.smoke or jax.default_backend() != "gpu"
  models = SMOKE_MODELS if smoke else MODELS
  if args.models:
    unknown = sorted(set(args.models.split(",")) - set(models))
    if unknown:
      ap.error(f"--models: unknown {', '.join(unknown)}; valid: {', '.join(models)}")
    models = {k: models[k] for k in args.models.split(",")}
  try:
    lengths = (tuple(int(x) for x in args.lengths.split(",")) if args.lengths
               else SMOKE_LENGTHS if smoke else LENGTHS)
  except ValueError:
    ap.error(f"--lengths {args.lengths!r}: expected comma-separated sequence lengths")
  if min(lengths) < 1:
    ap.error(f"--lengths {args.lengths!r}: sequence lengths must be >= 1")
  dtype = jnp.bfloat16
  start = time.perf_counter()
  rows = run_bench(models, lengths, dtype, smoke, args.budget)
  device = jax.devices()[0]
  print(f"device: {getattr(device, 'device_kind', device.platform)}  backend: "
        f"{jax.default_backend()}  jax {jax.__version__}  cuDNN {attn.cudnn_version()}  "
        f"compute capability {attn.compute_capability()}" + ("  (SMOKE)" if smoke else ""))
  print(format_table(
      ("model", "N", "batch", "implementation", "ms fwd+bwd", "temp MiB", "auto", "fastest",
       "note"),
      [(r["model"], r["n"], r["batch"], r["implementation"],
        "-" if r["ms"] is None else f"{r['ms']:.4g}",
        "-" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.1f}",
        r["auto"], r["fastest_no_nxn"] or "-",
        r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason'][:70]}"
        + (f" [jax unchecked {r['jax_unchecked'][:40]}]" if r["jax_unchecked"] else ""))
       for r in rows]))
  disagree = sorted({(r["model"], r["n"]) for r in rows
                     if r["fastest_no_nxn"] and r["auto"] != r["fastest_no_nxn"]})
  if disagree and not smoke:
    print("auto differs from the fastest path at: "
          + ", ".join(f"{m} N={n}" for m, n in disagree) + " (see AUTO_GPU_TABLE)")
  result = {"jax_version": jax.__version__, "backend": jax.default_backend(),
            "device": str(getattr(device, "device_kind", device.platform)),
            "cudnn_version": attn.cudnn_version(),
            "compute_capability": attn.compute_capability(), "smoke": smoke,
            "dtype": jnp.dtype(dtype).name, "auto_gpu_table": attn.AUTO_GPU_TABLE,
            "seconds": round(time.perf_counter() - start, 2), "rows": rows,
            "auto_differs_from_fastest": [dict(model=m, n=n) for m, n in disagree]}
  write_json(args.json, result)
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
