"""Memory tools: what backward saves, and what the compiled step needs.

* :func:`step_memory` -- compiled memory of ``jit(fn)`` (``memory_analysis()``).
* :func:`peak_buffers` -- the buffers live at the compiled peak, with the Python source
  line of each (:mod:`lowmem_jax.buffer_assignment`): what the compiler keeps.
* :func:`saved_residuals` -- the arrays autodiff keeps for backward, arguments excluded.
* ``python -m lowmem_jax.memory`` -- each preset's residual bytes per token and compiled
  temp bytes on the built-in block stack (:mod:`lowmem_jax.block_stack`), side by side.

Both are deterministic for a given program: compare methods as ratios on the same
model and batch. On CPU compare remat policies in scan form (the CPU scheduler is not
memory-aware); the block stack scans its layers.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowmem_jax.buffer_assignment import Buffer, PeakBuffers, peak_buffers  # noqa: F401

MiB = 2 ** 20


# ----------------------------------------------------------------------------- compiled memory
@dataclasses.dataclass(frozen=True)
class StepMemory:
  """Compiled memory of one jitted function, in bytes."""
  temp: int
  argument: int
  output: int
  alias: int
  generated_code: int
  peak: int | None  # XLA:GPU's own peak estimate; None on CPU (its figure there is
                    # arguments + outputs only, no temporaries)

  @property
  def total(self) -> int:
    """Arguments + outputs + temporaries, less what outputs alias from arguments."""
    return self.argument + self.output + self.temp - self.alias

  def as_dict(self) -> dict[str, int | None]:
    return dict(dataclasses.asdict(self), total=self.total)


def step_memory(fn: Callable, *args, donate_argnums: int | Sequence[int] = (),
                compiler_options: dict | None = None, **kwargs) -> StepMemory:
  """Compiles ``jax.jit(fn)`` for these arguments and returns its memory figures;
  ``compiler_options``: ``jax.jit``'s (a policy's: ``MemoryPolicy.compiler_options``)."""
  jitted = jax.jit(fn, donate_argnums=donate_argnums, compiler_options=compiler_options)
  return compiled_memory(jitted.lower(*args, **kwargs).compile())


def compiled_memory(compiled) -> StepMemory:
  """The memory figures of an already compiled executable (``jit(f).lower(...).compile()``)."""
  stats = compiled.memory_analysis()
  if stats is None:
    raise RuntimeError(f"backend {jax.default_backend()!r} reports no memory_analysis()")
  peak = getattr(stats, "peak_memory_in_bytes", None)
  if _platform(compiled) == "cpu":  # XLA:CPU's figure is arguments + outputs, no temp
    peak = None
  return StepMemory(temp=int(stats.temp_size_in_bytes),
                    argument=int(stats.argument_size_in_bytes),
                    output=int(stats.output_size_in_bytes),
                    alias=int(stats.alias_size_in_bytes),
                    generated_code=int(stats.generated_code_size_in_bytes),
                    peak=None if not peak else int(peak))


def _platform(compiled) -> str | None:
  """The platform an executable was compiled for ("cpu", "cuda"), or None where it does not
  say (a deviceless compile for a GPU)."""
  try:
    return compiled.runtime_executable().client.platform
  except Exception:  # noqa: BLE001 - jax's AOT objects differ by backend and version
    return None


# ----------------------------------------------------------------------------- residuals
@dataclasses.dataclass(frozen=True)
class Residual:
  """One array that backward keeps."""
  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  source: str  # JAX's description: "output of mul from file:line (fn)", "named 'x' ..."

  @property
  def origin(self) -> str:
    """The function the array comes from: the source's trailing ``(name)``, unqualified."""
    m = re.search(r"\(([^()]*)\)\s*$", self.source)
    return m.group(1).rsplit(".", 1)[-1] if m else self.source


@dataclasses.dataclass(frozen=True)
class SavedResiduals:
  """The residuals of a function's VJP, arguments excluded."""
  items: tuple[Residual, ...]

  @property
  def total_bytes(self) -> int:
    return sum(r.nbytes for r in self.items)

  def by_origin(self) -> dict[str, int]:
    """Bytes saved per originating function, largest first."""
    acc = collections.Counter()
    for r in self.items:
      acc[r.origin] += r.nbytes
    return dict(acc.most_common())

  def table(self) -> str:
    rows = [(f"{r.dtype}{list(r.shape)}", f"{r.nbytes:,}", r.source) for r in self.items]
    rows.append(("total", f"{self.total_bytes:,}", f"{len(self.items)} arrays"))
    return format_table(("array", "bytes", "source"), rows)


def _jax_saved_residuals(fn, *args, **kwargs):
  # jax.ad_checkpoint.print_saved_residuals prints what this returns; the list form is
  # not public, so reach for it and fail loudly if a JAX release moves it.
  try:
    from jax._src.ad_checkpoint import saved_residuals as impl
  except ImportError as e:  # pragma: no cover - depends on the JAX release
    raise RuntimeError("this JAX release has no jax._src.ad_checkpoint.saved_residuals; "
                       "use jax.ad_checkpoint.print_saved_residuals") from e
  return impl(fn, *args, **kwargs)


def saved_residuals(fn: Callable, *args, **kwargs) -> SavedResiduals:
  """The arrays that the VJP of ``fn(*args, **kwargs)`` keeps.

  Arguments, closed-over constants and literals are excluded: they live anyway.
  """
  items = []
  for aval, source in _jax_saved_residuals(fn, *args, **kwargs):
    if source.startswith(("from the argument", "from a constant", "from a literal")):
      continue
    shape = tuple(int(d) for d in aval.shape)
    # a typed PRNG key (dtype key<fry>) is held as its key data: itemsize counts it
    items.append(Residual(shape=shape, dtype=str(aval.dtype),
                          nbytes=math.prod(shape) * aval.dtype.itemsize, source=source))
  return SavedResiduals(tuple(items))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  """A plain fixed-width text table (first column left-aligned, the rest right)."""
  cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

  def line(r):
    return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(r, widths)))

  return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)]
                   + [line(r) for r in cells[1:]])


def error_line(e: BaseException, limit: int = 300) -> str:
  """A benchmark row's error: the exception's type and the first line of its message."""
  return f"{type(e).__name__}: {e}".strip().splitlines()[0][:limit]


def write_json(path: str | None, result: dict, *, announce: bool = True) -> None:
  """Writes a benchmark's figures as JSON (no-op without a path), atomically (a file
  rewritten as a sweep goes is never left half-written), and says where (``announce``)."""
  if path:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
      json.dump(result, f, indent=2)
    os.replace(tmp, path)
    if announce:
      print(f"wrote {path}")


# ----------------------------------------------------------------------------- the report
DEFAULT_PRESETS = ("baseline", "plain", "approx-bp", "ms-bp", "lowmembp",
                   "lowmembp+qkv=recompute", "remat", "remat:dots_saveable",
                   "remat:dots_with_no_batch_dims_saveable",
                   "remat:save=qkv_proj,attn_out", "lowmembp+remat")


def theoretical_bytes_per_token(cfg, policy, itemsize: int) -> int | None:
  """Per token per layer, what each op must save (PyTorch-style accounting, flash attention).

  Norm: input + fp32 stats (with affine) or output + fp32 rstd (MS, output shared with the
  next linear). Linear: its input. GELU: its input, or the bits per element its strategy
  keeps (approx2: 2). SwiGLU: gate and up (the exact rule keeping only them, which no
  2-bit code improves on). Under ``hidden=recompute`` the MLP's last linear keeps nothing
  and its activation its input(s) whole (``h``; ``g`` and ``u``). Attention: q, k, v, o
  and the fp32 log-sum-exp, or only o when its backward recomputes the rest from the
  norm output (``qkv=recompute``). A block
  that keeps only its input (full remat): that. None when a checkpoint policy decides
  (selective remat, offload), a norm or activation keeps codes (Mesa), or ops run under
  plain autodiff (``plain``): what is kept then is what the measurement shows.
  """
  saves = policy.block_strategy().saves
  if policy.autodiff == "plain":  # keeps what autodiff keeps: measured, not theorised
    return None
  if saves == "input":
    return cfg.dim * itemsize
  kind = ("layer", "gelu") if cfg.kind == "vit" else ("rms", "silu")
  norm_s, act_s = policy.norm_strategy(kind[0]), policy.activation_strategy(kind[1])
  if saves != "ops" or norm_s.init_state() or act_s.init_state():
    return None
  d, f, s = cfg.dim, cfg.mlp_dim, itemsize
  kvd = cfg.kv_heads * cfg.head_dim
  stats = 8 if cfg.kind == "vit" else 4
  norm = (d * s + stats + d * s) if norm_s.has_affine else (d * s + 4)
  if policy.qkv_strategy(cfg.num_heads, cfg.kv_heads).recomputes:
    attn = d * s                           # o, the out-projection's input
  else:
    attn = (d + 2 * kvd + d) * s + 4 * cfg.num_heads
  bits = act_s.saved_bits
  act_in = f * s if bits is None else f * bits // 8
  gated = cfg.kind == "llama"
  if policy.hidden_strategy(kind[1], gated=gated).recomputes:  # the input(s) only, whole
    mlp = (1 if cfg.kind == "vit" else 2) * f * s
  elif cfg.kind == "vit":
    mlp = act_in + f * s                   # GELU input + fc2 input
  else:
    mlp = 3 * f * s                        # gate and up (one exact rule), fc2 input
  return 2 * norm + attn + mlp


def _report_rows(cfg, policies, batch, seq, dtype):
  from lowmem_jax import block_stack
  from lowmem_jax.policy import MemoryPolicy

  rows = []
  tokens = batch * seq * cfg.num_layers
  for spec in policies:
    policy = MemoryPolicy.parse(spec)
    params = block_stack.init_stack(jax.random.key(0), cfg, policy)
    forward = functools.partial(block_stack.apply_stack, cfg=cfg, policy=policy)
    # Bytes per token: the residual growth from batch to 2*batch, so per-layer weights
    # (and their compute-dtype copies) do not count. The VJP of the stack itself: no loss.
    res = [saved_residuals(forward, params, jnp.zeros((b, seq, cfg.dim), dtype)).total_bytes
           for b in (batch, 2 * batch)]
    step = functools.partial(block_stack.sgd_step, cfg=cfg, policy=policy)
    mem, mem2 = (step_memory(step, params, jax.ShapeDtypeStruct((b, seq, cfg.dim), dtype))
                 for b in (batch, 2 * batch))
    rows.append({
        "policy": policy.spec,
        "residual_bytes_per_token_layer": (res[1] - res[0]) / tokens,
        "residual_bytes": res[0],
        "theory_bytes_per_token_layer": theoretical_bytes_per_token(
            cfg, policy, jnp.dtype(dtype).itemsize),
        "compiled": mem.as_dict(),
        # what the compiler keeps per token: the step's temp growth from batch to 2*batch
        "compiled_bytes_per_token_layer": (mem2.temp - mem.temp) / tokens,
    })
  return rows


def _trace_stack(cfg, spec: str, seq: int, dtype) -> None:
  """Traces one layer of the stack under ``spec``, nothing compiled: ValueError where the
  stack cannot take the policy (one that keeps state: Mesa's codes, WTA-CRS's samples)."""
  from lowmem_jax import block_stack
  from lowmem_jax.policy import MemoryPolicy

  policy, one = MemoryPolicy.parse(spec), dataclasses.replace(cfg, num_layers=1)
  params = jax.eval_shape(lambda: block_stack.init_stack(jax.random.key(0), one, policy))
  jax.eval_shape(functools.partial(block_stack.apply_stack, cfg=one, policy=policy), params,
                 jax.ShapeDtypeStruct((1, seq, cfg.dim), dtype))


def format_ratio(a, b) -> str:
  """``a / b`` to 3 decimals; "-" where either is missing or b is 0."""
  return "-" if a is None or not b else f"{a / b:.3f}"


def main(argv: Sequence[str] | None = None) -> dict:
  from lowmem_jax import cli_checks
  from lowmem_jax.block_stack import StackConfig

  ap = argparse.ArgumentParser(
      prog="python -m lowmem_jax.memory",
      description="Residual bytes per token and compiled step memory of each memory "
                  "policy on a built-in pre-LN Transformer block stack (scanned layers).")
  ap.add_argument("--kind", choices=("vit", "llama"), default="vit")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--dim", type=int, default=768)
  ap.add_argument("--heads", type=int, default=12)
  ap.add_argument("--kv-heads", type=int, default=None)
  ap.add_argument("--mlp-dim", type=int, default=3072)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=197)
  ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
  ap.add_argument("--policies", default=",".join(DEFAULT_PRESETS),
                  help="comma-separated policy specs (default: %(default)s)")
  ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
  args = ap.parse_args(argv)
  cli_checks.at_least(ap, args, "--layers", "--dim", "--heads", "--kv-heads", "--mlp-dim",
                      "--batch", "--seq")
  if args.dim % args.heads:
    ap.error(f"--dim {args.dim} is not divisible by --heads {args.heads}")
  if args.kv_heads is not None and args.heads % args.kv_heads:
    ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
  try:
    specs = policy_list(args.policies)
  except ValueError as e:
    ap.error(f"--policies: {e}")
  cli_checks.output_file(ap, args, "--json")
  cfg = StackConfig(kind=args.kind, num_layers=args.layers, dim=args.dim,
                    num_heads=args.heads, num_kv_heads=args.kv_heads, mlp_dim=args.mlp_dim)
  for spec in specs:
    try:
      _trace_stack(cfg, spec, args.seq, jnp.dtype(args.dtype))
    except ValueError as e:
      ap.error(f"--policies: the block stack cannot take {spec!r}: {str(e).split(';')[0]} "
               "(python -m models.step_memory measures it on a model)")
  rows = _report_rows(cfg, specs, args.batch, args.seq, jnp.dtype(args.dtype))

  base = next((r for r in rows if r["policy"] == "baseline"), rows[0])
  table = []
  for r in rows:
    table.append((
        r["policy"],
        f"{r['residual_bytes_per_token_layer']:.0f}",
        format_ratio(r["residual_bytes_per_token_layer"], base["residual_bytes_per_token_layer"]),
        "-" if r["theory_bytes_per_token_layer"] is None else r["theory_bytes_per_token_layer"],
        format_ratio(r["theory_bytes_per_token_layer"], base["theory_bytes_per_token_layer"]),
        f"{r['compiled_bytes_per_token_layer']:.0f}",
        format_ratio(r["compiled_bytes_per_token_layer"], base["compiled_bytes_per_token_layer"]),
        f"{r['compiled']['temp'] / MiB:.1f}",
        format_ratio(r["compiled"]["temp"], base["compiled"]["temp"]),
    ))
  print(f"{args.kind} block stack: {args.layers} layers, D={args.dim}, heads={args.heads}, "
        f"MLP={args.mlp_dim}, batch={args.batch}, seq={args.seq}, {args.dtype}, "
        f"backend={jax.default_backend()}")
  print(format_table(("policy", "saved B/tok/layer", "ratio", "theory B/tok/layer",
                      "ratio", "compiled B/tok/layer", "ratio", "compiled temp MiB", "ratio"),
                     table))
  result = {"config": vars(args), "backend": jax.default_backend(),
            "jax_version": jax.__version__, "rows": rows}
  write_json(args.json, result)
  return result


def policy_list(text: str) -> list[str]:
  """:func:`split_policies`, each spec checked: ValueError naming an invalid one, or an
  empty list."""
  from lowmem_jax.policy import MemoryPolicy
  specs = split_policies(text)
  if not specs:
    raise ValueError(f"names no policy, got {text!r}")
  for spec in specs:
    try:
      MemoryPolicy.parse(spec)
    except ValueError as e:
      raise ValueError(f"invalid policy {spec!r}: {e}") from None
  return specs


def split_policies(text: str) -> list[str]:
  """Splits a comma-separated policy list; commas inside ``remat:save=a,b`` and
  ``sample_targets=a,b`` stay put."""
  from lowmem_jax.policy import CHECKPOINT_NAMES, LINEAR_NAMES
  specs: list[str] = []
  for part in text.split(","):
    part = part.strip()
    if not part:
      continue
    head = part.split("+")[0]
    if specs and (("remat:save=" in specs[-1] and head in CHECKPOINT_NAMES)
                  or ("sample_targets=" in specs[-1] and head in LINEAR_NAMES)):
      specs[-1] += "," + part
    else:
      specs.append(part)
  return specs


if __name__ == "__main__":
  main(sys.argv[1:])
