"""``python -m train`` / ``lowmem-train``: fine-tune a model with a memory policy.

    python -m train                                   # digits ViT, lowmembp (the default)
    python -m train --config-name minilm-text         # the real MiniLM on sentiment
    python -m train --set policy=baseline --set steps=100 --set model.num_layers=2
    python -m train --resume                          # the newest run, with its own config

Each run writes to a new folder ``runs/<config name>/<YYYYmmdd-HHMMSS>`` unless ``--out-dir``
names one; ``--resume`` continues the newest run of the config (or ``--out-dir``'s) with
that run's own config.json and the command's ``--set`` on top, and ``--overwrite``
replaces the run in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from train.config import add_config_arguments, load_config


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(prog="python -m train", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  add_config_arguments(ap)
  ap.add_argument("--policy", help="shorthand for --set policy=...")
  ap.add_argument("--out-dir", metavar="DIR",
                  help="the run folder (default: a new runs/<config name>/<time>)")
  ap.add_argument("--resume", action="store_true",
                  help="continue the run in --out-dir (default: the newest run of the config)")
  ap.add_argument("--overwrite", action="store_true",
                  help="replace the run already in --out-dir")
  ap.add_argument("--profile", metavar="DIR",
                  help="write a jax.profiler trace to DIR (on a GPU also summarized: device "
                       "busy vs wall time per step, kernel time by kind)")
  ap.add_argument("--memory-profile", metavar="FILE",
                  help="save jax.profiler.device_memory_profile() after step 1")
  ap.add_argument("--mesh", help="data=N[,fsdp=M]: shard over N*M devices")
  ap.add_argument("--export", metavar="DIR", help="after training, write HF safetensors")
  args = ap.parse_args(argv)
  overrides = list(args.set)
  for key, value in (("policy", args.policy), ("out_dir", args.out_dir),
                     ("profile_dir", args.profile),
                     ("memory_profile", args.memory_profile), ("mesh", args.mesh),
                     ("export_dir", args.export)):
    if value is not None:
      overrides.append(f"{key}={value}")
  if args.resume:
    overrides.append("resume=true")
  if args.overwrite:
    overrides.append("overwrite=true")
  key = lambda o: o.partition("=")[0].strip()
  # --set resume=true is --resume (the last --set of it says)
  resume = load_config(None, None, [o for o in overrides if key(o) == "resume"]).resume
  config = args.config
  if resume and config and "out_dir" not in map(key, overrides):
    from train.runs import is_run_folder
    folder = os.path.dirname(os.path.abspath(config))
    if os.path.basename(config) == "config.json" and is_run_folder(folder):
      # --config <run>/config.json --resume: that run, as --out-dir <run> --resume
      config = None
      overrides.append(f"out_dir={folder}")
  if resume and args.config_name is None and config is None:
    # the run's own config.json, the command's settings on top (checked there, not on the
    # default config's): which run from the settings that say so
    from train.runs import RESUME_WHERE, resumed_config
    where = load_config(None, None, [o for o in overrides if key(o) in RESUME_WHERE])
    cfg = resumed_config(where, [o for o in overrides if key(o) != "resume"])
  else:
    cfg = load_config(args.config_name, config, overrides)
    from train.config import named_keys
    from train.runs import refuse_named_plan, refuse_named_with_budget, resumed_folder
    if cfg.resume:  # a planned run keeps its plan: a policy named here would be dropped
      refuse_named_plan(resumed_folder(cfg), named_keys(overrides), cfg.memory_budget)
    else:  # a new one takes its plan's
      refuse_named_with_budget(named_keys(overrides), cfg.memory_budget)

  from train.loop import train  # imports jax: after argument errors are reported
  result = train(cfg)
  print(json.dumps({k: v for k, v in result.items() if k != "memory"}))
  return result


def cli() -> None:
  """Entry point: clear one-line errors for bad configs, data, run folders, non-finite runs."""
  try:
    main()
  except (ValueError, OSError, FloatingPointError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except KeyboardInterrupt as e:
    # train.loop's: how to continue the run it left in its folder
    again = next(iter(getattr(e, "__notes__", ())), None)
    print("\ninterrupted; " + (again or "no checkpoint was saved: nothing to resume"),
          file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
  cli()
