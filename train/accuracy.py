"""Does a memory policy cost accuracy? Fine-tune under each policy over several seeds.

    python -m train.accuracy                        # all runs, seeds 1, 2, 3
    python -m train.accuracy --runs digits-vit --seeds 1 --json out.json --markdown out.md
    python -m train.accuracy --set steps=50         # overrides apply to every run
    python -m train.accuracy --json a.json --resume # go on from what a.json holds

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
The JSON (every per-seed value) is rewritten after each fine-tune, the Markdown table after
each run; ``--resume`` reuses what the JSON holds (a killed sweep loses one fine-tune).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence

import jax
import numpy as np

from lowmem_jax.memory import format_table, write_json
from train import bench
from train.config import apply_overrides, load_config

# lowmem is lowmembp+mesa8 (the same policy: one row); qkv=recompute changes which codes
# attention's backward reads (the norm output's, not q's, k's and v's)
COMPARED = ("baseline", "lowmembp", "mesa8", "wta-crs", "offload", "lowmem",
            "lowmem+qkv=recompute")
# LoRA: under wta-crs the adapters' A (the trained linear of each target) is sampled
LORA_COMPARED = ("baseline", "wta-crs", "lowmembp", "lowmembp+wta-crs", "lowmem",
                 "lowmem+wta-crs", "lowmem+qkv=recompute")
DEFAULT_SEEDS = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Run:
  config: str                       # a named config of train.config
  policies: tuple[str, ...]         # the first is the reference of every ratio and difference
  overrides: tuple[str, ...] = ()   # key=value, applied before the command line's --set


RUNS = {
    # + the MLP's hidden recomputed from the codes of its input (mesa8's exact GELU codes
    # it; lowmem's 2-bit GELU keeps its code, so there it would be lowmem)
    "digits-vit": Run("digits-vit", COMPARED + ("mesa8+hidden=recompute",)),
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


# the fields every fine-tune of the sweep sets itself (train_seed): a --set of one is refused
SWEEP_FIELDS = ("policy", "seed", "out_dir", "compare_baseline", "save_every", "eval_every",
                "export_dir", "resume", "overwrite")


def seed_config(cfg, spec: str, seed: int, out: str | None):
  """``cfg`` as one fine-tune of the sweep runs it: policy ``spec``, ``seed``, folder
  ``out``, evaluated once at the end, nothing saved."""
  return cfg.with_policy(spec, seed=seed, out_dir=out, compare_baseline=False,
                         save_every=0, eval_every=cfg.steps, export_dir=None, resume=False,
                         overwrite=False)


def train_seed(cfg, spec: str, seed: int) -> dict:
  """One fine-tune of ``cfg`` under policy ``spec`` and ``seed``, in a throwaway folder."""
  from train.loop import train
  with tempfile.TemporaryDirectory() as out:
    result = train(seed_config(cfg, spec, seed, out))
  jax.clear_caches()  # this run's compiled steps: a sweep would hold dozens of them
  return {"seed": seed, "eval_accuracy": result.get("eval_accuracy"),
          "eval_loss": result.get("eval_loss"), "train_loss": result["loss"]}


SEED_KEYS = ("seed", "eval_accuracy", "eval_loss", "train_loss")  # train_seed's result


def run_one(name: str, overrides: Sequence[str], bench_steps: int, warmup: int,
            seeds: Sequence[int] = DEFAULT_SEEDS, done: dict | None = None,
            on_trained=None) -> dict:
  """Every policy of run ``name`` trained once per seed, then benched once; the JSON result.
  ``done`` maps ``(policy, seed)`` to a per-seed result already had (not trained again);
  ``on_trained(policy, result)`` is called after each new fine-tune."""
  cfg = run_config(name, overrides)
  policies = RUNS[name].policies
  per_seed = {spec: [] for spec in policies}
  for seed in seeds:
    for spec in policies:
      result = (done or {}).get((spec, seed))
      if result is None:
        print(f"\n== {name}: {spec}, seed {seed}", flush=True)
        result = train_seed(cfg, spec, seed)
        if on_trained is not None:
          on_trained(spec, result)
      per_seed[spec].append(result)
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
  bench_rows = {b["policy"]: b for b in speed["rows"]}
  for row in rows:
    if row["policy"] not in bench_rows:  # trained, yet its bench step failed: say so
      raise RuntimeError(f"train.bench failed on policy {row['policy']!r}: "
                         f"{speed.get('failed', {}).get(row['policy'])}")
    b = bench_rows[row["policy"]]
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


class Progress:
  """The sweep's JSON file: finished runs (``results``, in RUNS order) and the fine-tunes of
  the unfinished one (``partial``), rewritten after every fine-tune. With ``resume`` it
  starts from what the file holds for the same seeds and overrides (the rest is dropped),
  so a killed sweep goes on where it stopped and runs can be added one invocation at a time;
  a finished run whose policies changed since is redone from its kept fine-tunes (a policy
  added to a run trains only that policy)."""

  def __init__(self, path: str | None, seeds: Sequence[int], overrides: Sequence[str],
               resume: bool = False):
    self.path, self.seeds, self.overrides = path, list(seeds), list(overrides)
    saved = {}
    if resume and os.path.exists(path):
      with open(path) as f:
        try:
          saved = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
          raise ValueError(f"--resume: {path} is not valid JSON ({e}); name the sweep's "
                           "--json file, or drop --resume to start afresh") from None
      if not isinstance(saved, dict):
        raise ValueError(f"--resume: {path} holds no sweep (a JSON object with "
                         "\"results\")")
    self.results = [r for r in saved.get("results", [])
                    if self._same_run(r) and r["seeds"] == self.seeds]
    self.partial = [p for p in saved.get("partial", [])
                    if self._same_run(p) and p["seed"] in self.seeds]
    for r in [r for r in self.results if self._policies_changed(r)]:
      # the run's policies changed since: its fine-tunes are kept, the run is redone
      self.results.remove(r)
      self.partial += [{"run": r["run"], "overrides": r["overrides"], "policy": row["policy"],
                        **{k: seed[k] for k in SEED_KEYS}}
                       for row in r["rows"] if row["policy"] in RUNS[r["run"]].policies
                       for seed in row["seeds"]]
    if resume:
      print(f"resuming from {path}: {len(self.results)} finished runs, "
            f"{len(self.partial)} fine-tunes", flush=True)

  def _same_run(self, entry: dict) -> bool:
    run = RUNS.get(entry.get("run"))
    return run is not None and entry.get("overrides") == [*run.overrides, *self.overrides]

  @staticmethod
  def _policies_changed(result: dict) -> bool:
    return [row["policy"] for row in result["rows"]] != list(RUNS[result["run"]].policies)

  def result(self, name: str) -> dict | None:
    """The finished run ``name``, if saved."""
    return next((r for r in self.results if r["run"] == name), None)

  def done(self, name: str) -> dict:
    """``(policy, seed) -> result`` of run ``name``'s saved fine-tunes."""
    return {(p["policy"], p["seed"]): {k: p[k] for k in SEED_KEYS}
            for p in self.partial if p["run"] == name}

  def trained(self, name: str, policy: str, result: dict) -> None:
    self.partial.append({"run": name, "overrides": [*RUNS[name].overrides, *self.overrides],
                         "policy": policy, **result})
    self._write()

  def finished(self, result: dict) -> None:
    order = list(RUNS)
    self.results = sorted([r for r in self.results if r["run"] != result["run"]] + [result],
                          key=lambda r: order.index(r["run"]))
    self.partial = [p for p in self.partial if p["run"] != result["run"]]
    self._write()

  def _write(self) -> None:
    data = {"results": self.results, **({"partial": self.partial} if self.partial else {})}
    write_json(self.path, data, announce=False)  # atomic: a kill leaves the previous file


def check_run(name: str, overrides: Sequence[str], seeds: Sequence[int]) -> None:
  """Raises ValueError on what would stop run ``name`` with ``overrides`` after earlier
  fine-tunes: a bad override, a file the config names that is missing, a model field its
  model (preset or pretrained config.json) lacks, a policy the config refuses."""
  from train.loop import check_inputs
  cfg = run_config(name, overrides)
  check_inputs(cfg)  # a pretrained model's config.json and tensor headers too
  for spec in RUNS[name].policies:
    seed_config(cfg, spec, seeds[0], None)


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
                  help="config override for every run (repeatable); refused: the fields "
                  f"the sweep sets itself ({', '.join(SWEEP_FIELDS)}; seeds: --seeds)")
  ap.add_argument("--bench-steps", type=int, default=20, help="timed steps per policy")
  ap.add_argument("--warmup", type=int, default=3, help="untimed steps per policy first")
  ap.add_argument("--json", metavar="FILE", help="results, written after every fine-tune")
  ap.add_argument("--resume", action="store_true", help="reuse what --json FILE holds for "
                  "these seeds and overrides (finished runs, fine-tunes of a partial run)")
  ap.add_argument("--markdown", metavar="FILE")
  args = ap.parse_args(argv)
  from lowmem_jax import cli_checks
  names = [n.strip() for n in args.runs.split(",") if n.strip()]
  if args.resume and not args.json:
    ap.error("--resume reads --json FILE: name it")
  if not names:
    ap.error(f"--runs {args.runs!r} names no run; valid: {', '.join(RUNS)}")
  for n in names:
    if n not in RUNS:
      ap.error(f"unknown run {n!r}; valid: {', '.join(RUNS)}")
  cli_checks.at_least(ap, args, "--bench-steps")
  cli_checks.at_least(ap, args, "--warmup", minimum=0)
  cli_checks.output_file(ap, args, "--json", "--markdown")
  for item in args.set:
    key = item.partition("=")[0].strip()
    if key == "seed":
      ap.error("--set seed=N: the seeds come from --seeds (e.g. --seeds N)")
    if key in SWEEP_FIELDS:
      ap.error(f"--set {item}: the sweep sets {key} itself for every fine-tune")
  try:
    seeds = parse_seeds(args.seeds)
  except ValueError as e:
    ap.error(str(e))
  for n in names:  # before the first fine-tune: a later run's bad config wastes the sweep
    try:
      check_run(n, args.set, seeds)
    except ValueError as e:
      ap.error(f"run {n}: {e}")
  try:
    state = Progress(args.json, seeds, args.set, resume=args.resume)
  except ValueError as e:
    ap.error(str(e))
  for n in names:
    if state.result(n) is None:
      state.finished(run_one(n, args.set, args.bench_steps, args.warmup, seeds,
                             done=state.done(n),
                             on_trained=lambda spec, r, n=n: state.trained(n, spec, r)))
    if args.markdown:  # every finished run in the file (with --resume, earlier ones too)
      with open(args.markdown, "w") as f:
        f.write(markdown(state.results))
  if args.json:
    print(f"wrote {args.json}")
  print()
  print(format_table(HEADERS, table_rows(state.results)))
  return state.results


if __name__ == "__main__":
  try:
    main(sys.argv[1:])
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
