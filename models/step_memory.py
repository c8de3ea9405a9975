"""Compiled memory of a whole training step of our models, under each memory policy.

``python -m models.step_memory --model vit-b16 --batch 64`` (or ``--model llama-7b
--set num_layers=2 --seq 512``) builds the model under each policy, jits a full step
(cross-entropy loss, gradients of every parameter, an SGD update) and prints
``memory_analysis()`` figures side by side as ratios to ``baseline`` (to the first
policy when it is not listed), plus the bytes that backward saves (``saved_residuals``).
Nothing is executed: it compiles only.

``--explain`` also prints, for each policy, the buffers live at the compiled step's
peak and the Python source line that made each (:func:`lowmem_jax.memory.peak_buffers`):
what the compiler keeps, which is what to read before claiming a saving.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lowmem_jax import cli_checks
from lowmem_jax.memory import (MiB, format_ratio, format_table, peak_buffers, policy_list,
                               saved_residuals, step_memory, write_json)
from lowmem_jax.policy import MemoryPolicy
from models import registry

DEFAULT_POLICIES = ("baseline", "plain", "approx-bp", "ms-bp", "lowmembp", "remat", "lowmembp+remat",
                    "mesa8", "lowmembp+mesa8", "wta-crs")


def build(model_name: str, policy, dtype, overrides: dict):
  """A model by preset name (any family of :mod:`models.registry`) under ``policy``."""
  return registry.build(model_name, policy, dtype=dtype, **overrides)


def example_batch(model, batch: int, seq: int):
  """(inputs, integer targets) of the right shapes for ``model``: images or tokens by
  its family's input kind, targets shaped like its logits without the class axis."""
  cfg = model.cfg
  if registry.family_of(model).inputs == "image":
    inputs = jnp.zeros((batch, cfg.image_size, cfg.image_size, cfg.channels), jnp.float32)
  else:
    inputs = jnp.zeros((batch, seq), jnp.int32)
  logits = nnx.eval_shape(lambda m, x: m(x), model, inputs)
  return inputs, jnp.zeros(logits.shape[:-1], jnp.int32)


def loss_fn(model, inputs, targets):
  """Mean cross-entropy; a language model's through its fused chunked head and loss
  (``token_losses``: no [B, T, V] fp32 logits), as the trainer computes it."""
  if hasattr(model, "token_losses"):
    losses, _ = model.token_losses(inputs, targets)
  else:
    losses = optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets)
  return jnp.mean(losses)


def sgd_step(graphdef, params, rest, inputs, targets, lr=1e-3):
  """One full step on the split model: loss, gradients of all Params, SGD update."""
  def loss_of(params):
    return loss_fn(nnx.merge(graphdef, params, rest, copy=True), inputs, targets)
  loss, grads = jax.value_and_grad(loss_of)(params)
  return loss, jax.tree.map(lambda p, g: p - lr * g, params, grads)


def step_args(model_name, spec, batch, seq, dtype, overrides):
  """``(graphdef, params, rest, inputs, targets)`` of the step, all abstract: shapes only,
  nothing allocated (a 7B-wide model compiles on a laptop)."""
  model = nnx.eval_shape(lambda: build(model_name, MemoryPolicy.parse(spec), dtype, overrides))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  inputs, targets = jax.eval_shape(lambda: example_batch(model, batch, seq))
  return graphdef, params, rest, inputs, targets


def explain(model_name, spec, batch, seq, dtype, overrides, top: int = 20):
  """The buffers live at the peak of the compiled step under ``spec``."""
  graphdef, *args = step_args(model_name, spec, batch, seq, dtype, overrides)
  step = jax.jit(sgd_step, compiler_options=MemoryPolicy.parse(spec).compiler_options())
  return peak_buffers(step, graphdef, *args, top=top)


def measure(model_name, policies, batch, seq, dtype, overrides):
  rows = []
  for spec in policies:
    graphdef, params, rest, inputs, targets = step_args(model_name, spec, batch, seq, dtype,
                                                        overrides)
    mem = step_memory(sgd_step, graphdef, params, rest, inputs, targets,
                      compiler_options=MemoryPolicy.parse(spec).compiler_options())
    res = saved_residuals(
        lambda p, r, x, t: loss_fn(nnx.merge(graphdef, p, r, copy=True), x, t),
        params, rest, inputs, targets)
    rows.append({"policy": MemoryPolicy.parse(spec).spec, "compiled": mem.as_dict(),
                 "saved_residual_bytes": res.total_bytes})
  return rows


def _overrides(items: Sequence[str]) -> dict:
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"expects key=value, got {item!r}")
    try:
      out[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[key] = value
  return out


def main(argv: Sequence[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(prog="python -m models.step_memory", description=__doc__)
  ap.add_argument("--model", default="vit-b16")
  ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                  help="override a config field, e.g. --set num_layers=2")
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--seq", type=int, default=512, help="sequence length (LLaMA)")
  ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
  ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
  ap.add_argument("--json", metavar="FILE")
  ap.add_argument("--explain", action="store_true",
                  help="also print the buffers live at each policy's compiled peak")
  ap.add_argument("--top", type=int, default=20, help="buffers and lines --explain shows")
  args = ap.parse_args(argv)
  cli_checks.at_least(ap, args, "--batch", "--seq", "--top")
  cli_checks.output_file(ap, args, "--json")
  try:
    family = registry.family(args.model)
  except ValueError as e:
    ap.error(f"--model: {e}")
  try:
    overrides = _overrides(args.set)
    cfg = registry.config(args.model, **overrides)
  except ValueError as e:
    ap.error(f"--set: {e}")
  max_tokens = getattr(cfg, "max_tokens", None)
  if family.inputs == "tokens" and max_tokens and args.seq > max_tokens:
    ap.error(f"--seq {args.seq} exceeds the {max_tokens} positions of {args.model}")
  try:
    policies = policy_list(args.policies)
    for spec in policies:  # one the model refuses: before anything compiles
      try:
        nnx.eval_shape(lambda: build(args.model, MemoryPolicy.parse(spec),
                                     jnp.dtype(args.dtype), overrides))
      except ValueError as e:
        raise ValueError(f"{spec}: {e}") from None
  except ValueError as e:
    ap.error(f"--policies: {e}")
  rows = measure(args.model, policies, args.batch, args.seq,
                 jnp.dtype(args.dtype), overrides)
  base = next((r for r in rows if r["policy"] == "baseline"), rows[0])
  print(f"{args.model} {overrides or ''} batch {args.batch}"
        + ("" if registry.family(args.model).inputs == "image" else f" seq {args.seq}")
        + f", {args.dtype}, full train step (loss, grads, SGD), backend {jax.default_backend()}"
        + f"; ratios to {base['policy']}")
  print(format_table(
      ("policy", "temp MiB", "ratio", "total MiB", "ratio", "saved residuals MiB", "ratio"),
      [(r["policy"], f"{r['compiled']['temp'] / MiB:.1f}",
        format_ratio(r["compiled"]["temp"], base["compiled"]["temp"]),
        f"{r['compiled']['total'] / MiB:.1f}",
        format_ratio(r["compiled"]["total"], base["compiled"]["total"]),
        f"{r['saved_residual_bytes'] / MiB:.1f}",
        format_ratio(r["saved_residual_bytes"], base["saved_residual_bytes"])) for r in rows]))
  result = {"model": args.model, "overrides": overrides, "batch": args.batch,
            "seq": args.seq, "dtype": args.dtype, "backend": jax.default_backend(),
            "jax_version": jax.__version__, "rows": rows}
  if args.explain:
    for row in rows:
      peak = explain(args.model, row["policy"], args.batch, args.seq, jnp.dtype(args.dtype),
                     overrides, top=args.top)
      print(f"\n[{row['policy']}] " + peak.table(top=args.top))
      row["peak_buffers"] = {"peak_bytes": peak.peak_bytes,
                             "by_source": [list(r) for r in peak.by_source()[:args.top]]}
  write_json(args.json, result)
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
