"""Does a memory policy cost accuracy? Fine-tune under each policy, same seed and steps.

    python -m train.accuracy                        # digits ViT, RevViT, MiniLM (all runs)
    python -m train.accuracy --runs digits-vit --json out.json --markdown out.md
    python -m train.accuracy --set steps=50         # overrides apply to every run

For each run (a named config, optionally another model) and each policy, trains from
the same initial weights, data order and step count (:func:`train.loop.train`) and
records the final eval accuracy and loss; then :func:`train.bench.run` measures the
compiled step memory (temporaries) and the step time of all the run's policies,
interleaved in one process, as ratios to the first policy (``baseline``). Prints a table
and writes JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence

from lowmem_jax.memory import format_table, write_json
from train import bench
from train.config import apply_overrides, load_config

COMPARED = ("baseline", "lowmembp", "mesa8", "wta-crs", "lowmembp+mesa8")
# name: (config, model override or None, policies)
RUNS = {
    "digits-vit": ("digits-vit", None, COMPARED),
    "digits-revvit": ("digits-vit", "revvit-digits", ("baseline", "reversible", "pareprop")),
    "minilm-text": ("minilm-text", None, COMPARED),
}


def run_one(name: str, overrides: Sequence[str], bench_steps: int, warmup: int) -> dict:
  from train.loop import train
  config_name, model, policies = RUNS[name]
  cfg = apply_overrides(load_config(config_name), overrides)
  if model is not None:
    cfg = cfg.replace(model=model)
  rows = []
  for spec in policies:
    with tempfile.TemporaryDirectory() as out:
      run_cfg = cfg.replace(policy=spec, out_dir=out, compare_baseline=False, save_every=0,
                            eval_every=cfg.steps, export_dir=None, resume=False)
      print(f"\n== {name}: {spec}", flush=True)
      result = train(run_cfg)
    rows.append({"policy": spec, "eval_accuracy": result.get("eval_accuracy"),
                 "eval_loss": result.get("eval_loss"), "train_loss": result["loss"]})
  speed = bench.run(cfg, list(policies), bench_steps, warmup)
  for row, b in zip(rows, speed["rows"]):
    row.update(temp_mib=b["temp_mib"], temp_ratio=b["temp_ratio"], step_ms=b["step_ms"],
               speed_ratio=b["speed_ratio"])
  return {"run": name, "config": config_name, "model": cfg.pretrained or cfg.model,
          "steps": cfg.steps, "batch_size": cfg.batch_size, "seed": cfg.seed,
          "device_kind": speed["device_kind"], "backend": speed["backend"],
          "jax_version": speed["jax_version"], "rows": rows}


HEADERS = ("run", "policy", "eval acc", "eval loss", "train loss", "temp MiB", "temp/base",
           "step ms", "speed/base")


def table_rows(results: Sequence[dict]) -> list[list[str]]:
  rows = []
  for res in results:
    for r in res["rows"]:
      rows.append([f"{res['run']} ({res['model']})", r["policy"], f"{r['eval_accuracy']:.4f}",
                   f"{r['eval_loss']:.4f}", f"{r['train_loss']:.4f}", f"{r['temp_mib']:.1f}",
                   f"{r['temp_ratio']:.3f}", f"{r['step_ms']:.1f}", f"{r['speed_ratio']:.3f}"])
  return rows


def markdown(results: Sequence[dict]) -> str:
  lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
  lines += ["| " + " | ".join(r) + " |" for r in table_rows(results)]
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict]:
  ap = argparse.ArgumentParser(prog="python -m train.accuracy", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated: "
                  f"{', '.join(RUNS)} (default: all)")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="config override for every run (repeatable)")
  ap.add_argument("--bench-steps", type=int, default=20, help="timed steps per policy")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--json", metavar="FILE")
  ap.add_argument("--markdown", metavar="FILE")
  args = ap.parse_args(argv)
  names = [n.strip() for n in args.runs.split(",") if n.strip()]
  for n in names:
    if n not in RUNS:
      ap.error(f"unknown run {n!r}; valid: {', '.join(RUNS)}")
  results = [run_one(n, args.set, args.bench_steps, args.warmup) for n in names]
  print()
  print(format_table(HEADERS, table_rows(results)))
  write_json(args.json, {"results": results})
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(markdown(results))
  return results


if __name__ == "__main__":
  try:
    main(sys.argv[1:])
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
