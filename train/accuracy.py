"""Does a memory policy cost accuracy? Fine-tune under each policy over several seeds.

    python -m train.accuracy                        # all runs, seeds 1, 2, 3
    python -m train.accuracy --runs digits-vit --seeds 1 --json out.json --markdown out.md
    python -m train.accuracy --set steps=50         # overrides apply to every run

For each run (a named config and its own overrides) and each policy, trains once per seed
(:func:`train.loop.train`); within a seed every policy starts from the same initial weights
and sees the same data in the same order. The seed (``TrainConfig.seed``) sets the model's
initialisation (for a pretrained model: its new classifier head), the LoRA adapters' ``A``,
the batch order, the sites' random keys (WTA-CRS sampling, Mesa's stochastic rounding) and,
for digits, the stratified train/test split. Each row gives the final eval accuracy and
loss as mean, sample std and min..max over the seeds, and the accuracy's paired difference
to the run's first policy (``baseline``) seed by seed. Then :func:`train.bench.run`
measures, once per run (first seed), the compiled step memory (temporaries) and the step
time of the run's policies, interleaved in one process, as ratios to the first policy.
Writes JSON (every per-seed value) and a Markdown table after each run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
from collections.abc import Sequence

import jax
import numpy as np

from lowmem_jax.memory import format_table, write_json
from train import bench
from train.config import apply_overrides, load_config

COMPARED = ("baseline", "lowmembp", "mesa8", "wta-crs", "lowmembp+mesa8", "offload", "lowmem")
# LoRA: under wta-crs the adapters' A (the trained linear of each target) is sampled
LORA_COMPARED = ("baseline", "wta-crs", "lowmembp", "lowmembp+wta-crs")
DEFAULT_SEEDS = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Run:
  config: str                       # a named config of train.config
  policies: tuple[str, ...]         # the first is the reference of every ratio and difference
  overrides: tuple[str, ...] = ()   # key=value, applied before the command line's --set


RUNS = {
    "digits-vit": Run("digits-vit", COMPARED),
    "digits-revvit": Run("digits-vit", ("baseline", "reversible", "pareprop"),
                         ("model=revvit-digits",)),
    "minilm-text": Run("minilm-text", COMPARED),
    "minilm-lora": Run("minilm-text", LORA_COMPARED,
                       ("trainable=lora", "lora_targets=query,key,value,out,fc1,fc2",
                        "lora_rank=8", "lr=1e-3")),
}


def run_config(name: str, overrides: Sequence[str] = ()):
  """The TrainConfig of run ``name``: its named config, its overrides, then ``overrides``."""
  if name not in RUNS:
    raise ValueError(f"unknown run {name!r}; valid: {', '.join(RUNS)}")
  run = RUNS[name]
  return apply_overrides(load_config(run.config), [*run.overrides, *overrides])


def spread(values: Sequence[float]) -> dict:
  """Mean, sample standard deviation (n - 1; None for one value), min and max."""
  v = np.asarray(values, dtype=np.float64)
  return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else None,
          "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}


def train_seed(cfg, spec: str, seed: int) -> dict:
  """One fine-tune of ``cfg`` under policy ``spec`` and ``seed``, in a throwaway folder."""
  from train.loop import train
  with tempfile.TemporaryDirectory() as out:
    result = train(cfg.replace(policy=spec, seed=seed, out_dir=out, compare_baseline=False,
                               save_every=0, eval_every=cfg.steps, export_dir=None,
                               resume=False))
  jax.clear_caches()  # this run's compiled steps: a sweep would hold dozens of them
  return {"seed": seed, "eval_accuracy": result.get("eval_accuracy"),
          "eval_loss": result.get("eval_loss"), "train_loss": result["loss"]}


def run_one(name: str, overrides: Sequence[str], bench_steps: int, warmup: int,
            seeds: Sequence[int] = DEFAULT_SEEDS) -> dict:
  """Every policy of run ``name`` trained once per seed, then benched once; the JSON result."""
  cfg = run_config(name, overrides)
  policies = RUNS[name].policies
  per_seed = {spec: [] for spec in policies}
  for seed in seeds:
    for spec in policies:
      print(f"\n== {name}: {spec}, seed {seed}", flush=True)
      per_seed[spec].append(train_seed(cfg, spec, seed))
  base = per_seed[policies[0]]
  rows = []
  for spec in policies:
    runs = per_seed[spec]
    rows.append({"policy": spec, "seeds": runs,
                 **{k: spread([r[k] for r in runs])
                    for k in ("eval_accuracy", "eval_loss", "train_loss")},
                 "eval_accuracy_vs_base": spread([r["eval_accuracy"] - b["eval_accuracy"]
                                                  for r, b in zip(runs, base)])})
  speed = bench.run(cfg.replace(seed=seeds[0]), list(policies), bench_steps, warmup)
  for row, b in zip(rows, speed["rows"]):
    row.update(temp_mib=b["temp_mib"], temp_ratio=b["temp_ratio"], step_ms=b["step_ms"],
               speed_ratio=b["speed_ratio"])
  return {"run": name, "config": RUNS[name].config, "overrides": [*RUNS[name].overrides,
                                                                     *overrides],
          "model": cfg.pretrained or cfg.model, "trainable": cfg.trainable, "steps": cfg.steps,
          "batch_size": cfg.batch_size, "lr": cfg.lr, "seeds": list(seeds),
          "bench_seed": seeds[0], "device_kind": speed["device_kind"],
          "backend": speed["backend"], "jax_version": speed["jax_version"], "rows": rows}


def mean_std(s: dict, digits: int = 4, signed: bool = False) -> str:
  """``mean ± std`` (the mean alone for one seed)."""
  sign = "+" if signed else ""
  text = f"{s['mean']:{sign}.{digits}f}"
  return text if s["std"] is None or math.isnan(s["std"]) else f"{text} ± {s['std']:.{digits}f}"


def min_max(s: dict, digits: int = 4) -> str:
  return f"{s['min']:.{digits}f}..{s['max']:.{digits}f}"


HEADERS = ("run", "policy", "eval acc", "acc min..max", "acc - base", "eval loss",
           "loss min..max", "temp MiB", "temp/base", "step ms", "speed/base")


def table_rows(results: Sequence[dict]) -> list[list[str]]:
  rows = []
  for res in results:
    for r in res["rows"]:
      rows.append([f"{res['run']} ({res['model']})", r["policy"], mean_std(r["eval_accuracy"]),
                   min_max(r["eval_accuracy"]), mean_std(r["eval_accuracy_vs_base"], signed=True),
                   mean_std(r["eval_loss"]), min_max(r["eval_loss"]), f"{r['temp_mib']:.1f}",
                   f"{r['temp_ratio']:.3f}", f"{r['step_ms']:.1f}", f"{r['speed_ratio']:.3f}"])
  return rows


def caption(results: Sequence[dict]) -> str:
  """What the figures are: seeds, spread, where the bench ran."""
  seeds = sorted({s for res in results for s in res["seeds"]})
  devices = sorted({f"{res['device_kind']} ({res['backend']}, jax {res['jax_version']})"
                    for res in results})
  return (f"Eval accuracy and loss: mean ± sample std over seeds {', '.join(map(str, seeds))} "
          f"(min..max beside); acc - base: each seed's accuracy minus the first policy's "
          f"(same init and data), mean ± std. temp (compiled step temporaries) and step time: "
          f"one bench per run (first seed), ratios to the first policy; device: "
          f"{', '.join(devices)}.")


def markdown(results: Sequence[dict]) -> str:
  lines = [caption(results), "", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
  lines += ["| " + " | ".join(r) + " |" for r in table_rows(results)]
  return "\n".join(lines) + "\n"


def parse_seeds(text: str) -> list[int]:
  """``"1,2,3"`` -> ``[1, 2, 3]``; distinct non-negative integers."""
  try:
    seeds = [int(s) for s in text.split(",") if s.strip()]
  except ValueError:
    raise ValueError(f"--seeds expects comma-separated integers, got {text!r}") from None
  if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
    raise ValueError(f"--seeds expects distinct non-negative integers, got {text!r}")
  return seeds


def main(argv: Sequence[str] | None = None) -> list[dict]:
  ap = argparse.ArgumentParser(prog="python -m train.accuracy", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated: "
                  f"{', '.join(RUNS)} (default: all)")
  ap.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)),
                  help="comma-separated seeds, each (run, policy) trained once per seed "
                  "(default: %(default)s)")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="config override for every run (repeatable; not seed: use --seeds)")
  ap.add_argument("--bench-steps", type=int, default=20, help="timed steps per policy")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--json", metavar="FILE")
  ap.add_argument("--markdown", metavar="FILE")
  args = ap.parse_args(argv)
  names = [n.strip() for n in args.runs.split(",") if n.strip()]
  for n in names:
    if n not in RUNS:
      ap.error(f"unknown run {n!r}; valid: {', '.join(RUNS)}")
  if any(item.partition("=")[0].strip() == "seed" for item in args.set):
    ap.error("--set seed=N: the seeds come from --seeds (e.g. --seeds N)")
  try:
    seeds = parse_seeds(args.seeds)
  except ValueError as e:
    ap.error(str(e))
  results = []
  for n in names:
    results.append(run_one(n, args.set, args.bench_steps, args.warmup, seeds))
    write_json(args.json, {"results": results})  # after each run: a long sweep keeps its part
    if args.markdown:
      with open(args.markdown, "w") as f:
        f.write(markdown(results))
  print()
  print(format_table(HEADERS, table_rows(results)))
  return results


if __name__ == "__main__":
  try:
    main(sys.argv[1:])
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
