"""The memory-budget planner: the fastest training plan whose compiled peak fits a budget.

A plan is a memory policy and a micro-batch size that divides the configured batch
(``grad_accum = batch_size / micro``: the global batch, hence the training, stays the one
configured). Each candidate's train step is compiled ahead of time: the model and optimizer
state are abstract (``jax.eval_shape``), so nothing is materialized or run. Its peak is
predicted from the executable's ``memory_analysis()``::

    predicted peak = argument + output + temp - alias      (StepMemory.total)

The arguments (train state, batch) are live for the whole step; ``temp`` is the one scratch
allocation XLA gives the step, sized to the peak of its own liveness schedule; outputs that
alias a donated argument (the new state) take no memory of their own, the rest (metrics) do.
Outside the step, and so outside the prediction: the next batch put on the device while the
step runs, the eval step, the allocator's fragmentation (``auto``'s 10% margin is for them).
On CPU the figure is the CPU compiler's (a proxy: XLA:GPU fuses and schedules differently).

Expected speed: ``baseline``'s step time at the full batch over the candidate's (higher is
faster), its step time from ``train/speed_table.json`` (measured per device family: policy
step times relative to baseline, and the cost of each extra micro-batch); a policy or
penalty the device's family lacks, or an unknown device, uses the cost model of
:func:`modelled_step_time` (and the table says so).

Search (compiles bounded, fastest first): the candidates in speed order, each compiled
unless a smaller micro-batch of its policy is known not to fit; the first that fits is the
answer. A policy's second miss compiles its smallest micro-batch (of those faster than the
best so far): when that does not fit, no plan of the policy does; when it does, a bisection
finds the largest that fits, and the scan goes on until no faster candidate is left.
Every candidate left uncompiled is slower than the chosen one or larger than a
micro-batch of its policy that did not fit, so the chosen plan is the fastest that fits,
given that a policy's peak does not grow as its micro-batch shrinks (activations scale with
the micro-batch; the gradient accumulator is the same for every ``grad_accum >= 2``): the
skips and the bisection rest on that. At most ``3 + ceil(log2(#micro-batches - 2))``
compiles per policy (3 or more micro-batches; else one per micro-batch), 3 for a policy
none of whose plans fits (a budget that nothing fits costs 3 per policy); one in all when
the fastest fits.

Before any compile: every plan of a policy holds its train state (parameters, optimizer
state; the step's donated argument and, updated, its output), whatever the micro-batch, so
a budget below the least state of the policies fails at once (:func:`state_bytes`, from the
abstract trainer's shapes), with no candidate compiled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from lowmem_jax import gpu_target
from lowmem_jax.memory import MiB, compiled_memory, format_table
from lowmem_jax.policy import MemoryPolicy
from train import sharding
from train.config import TrainConfig, parse_budget
from train.model import build_model, model_family
from train.trainer import Trainer, no_bad_step

# The policies the planner chooses from, in expected speed order (the speed table decides
# the final order): baseline (exact); lowmembp (on an H100 0.89-0.99x baseline's step
# time, less memory where XLA does not already fuse it away); +hidden=recompute (the MLP's last linear reads
# its input recomputed: one elementwise pass, same gradients); +qkv=recompute (q, k, v
# recomputed for attention's backward from what the projections' input keeps: a twelfth
# of the forward again; with hidden, 1.7x lowmembp's tokens per step at LLaMA-7B widths,
# docs/h100_compiled.md); lowmem (= lowmembp+mesa8: int8 activations, a
# quantize/dequantize pass; on an H100 0.96-1.03x baseline's step time), with the same recomputes (the MLP's from the codes of
# g and u: 1.57x lowmem's tokens per step at LLaMA-7B widths with both); lowmembp+remat
# (recomputes each block's forward, ~1.33x, the least memory). baseline is exact; the
# others approximate the backward as their papers do (docs/methods.md).
DEFAULT_POLICIES = ("baseline", "lowmembp", "lowmembp+hidden=recompute",
                    "lowmembp+hidden=recompute+qkv=recompute", "lowmem",
                    "lowmem+hidden=recompute", "lowmem+qkv=recompute",
                    "lowmem+hidden=recompute+qkv=recompute", "lowmembp+remat")
# a reversible model's (revvit-*, revllama-*): its blocks take no norm, activation or
# attention choice, and keep no activations under reversible/pareprop
REVERSIBLE_POLICIES = ("baseline", "reversible", "pareprop", "lowmembp+reversible",
                       "lowmembp+pareprop")
# "auto": the device's allocator limit less this fraction, for what the prediction leaves
# out (the prefetched next batch, the eval step, fragmentation of the BFC allocator).
AUTO_MARGIN = 0.10
SPEED_TABLE = Path(__file__).with_name("speed_table.json")
# XLA options for the planner's compiles, per backend: only the memory figures are read, so
# skip LLVM's optimizations (CPU: the same memory_analysis() to the byte, half the compile
# time; measured on the tiny ViT steps of tests/test_planner.py). GPU: none (unmeasured).
PLAN_COMPILER_OPTIONS = {"cpu": {"xla_backend_optimization_level": 0,
                                 "xla_llvm_disable_expensive_passes": True}}

# The cost model (unknown devices; policies or penalties a family's table lacks), as step
# time relative to baseline: a train step is ~1 forward + ~2 forwards' work of backward, so
# recomputing the forward adds ~1/3; recomputing part of it (a remat policy that saves some
# tensors, or offload's transfers) ~1/6; Mesa's quantize (forward) and dequantize (backward)
# of every saved activation ~0.2 (H100, 7d7f55d: lowmembp+mesa8 1.14-1.26x; 75013e6:
# mesa8 1.14x, lowmem over lowmembp 0.97-1.16x); WTA-CRS's
# sampling and gathers ~0.1; qkv=recompute's q, k, v again, 3 D^2 per token of the 12 D^2
# a block's forward multiplies (q, k, v, out: D^2 each; the MLP's 4D-wide pair: 8 D^2),
# a quarter of the forward; hidden=recompute's activation output again, one elementwise
# pass (read g and u, write act(g) * u: 6F bytes per token against a block's ~6 (4 D^2 +
# 3 D F) flops; at LLaMA-7B widths on an H100 ~1% of the step).
# Each extra micro-batch: +5% (weights read again, smaller matmuls).
RECOMPUTE_FORWARD = 1 / 3
RECOMPUTE_PART = 1 / 6
RECOMPUTE_QKV = RECOMPUTE_FORWARD / 4
RECOMPUTE_HIDDEN = 0.01
QUANT_COST = 0.2
SAMPLING_COST = 0.1
MICRO_BATCH_PENALTY = 0.05


def modelled_step_time(policy: MemoryPolicy) -> float:
  """Step time relative to baseline by the recompute cost model (constants above)."""
  t = 1.0
  if policy.remat == "full" or policy.reversible != "none":
    t += RECOMPUTE_FORWARD  # block inputs or whole blocks recomputed in backward
  elif policy.remat is not None:
    t += RECOMPUTE_PART
  else:  # under remat these do nothing
    t += RECOMPUTE_QKV if policy.qkv == "recompute" else 0.0
    t += RECOMPUTE_HIDDEN if policy.hidden == "recompute" else 0.0
  if policy.quant != "none":
    t += QUANT_COST
  if policy.sampled_linear != "none":
    t += SAMPLING_COST
  return t


def load_speed_table(path: Path = SPEED_TABLE) -> dict:
  """``{family: {"step_time": {policy: t}, "micro_batch_penalty": p, ...}}``; ``_`` keys
  (comments) left out."""
  table = json.loads(path.read_text())
  return {k: v for k, v in table.items() if not k.startswith("_")}


def device_family(table: dict, device=None) -> str | None:
  """The speed table's family of ``device`` (default: the first): ``cpu`` for the CPU, else
  the family whose name is in the device kind (``h100`` in "NVIDIA H100 80GB HBM3"); None
  when none is."""
  target = gpu_target.active() if device is None else None
  if target is not None:
    kind = target.device_kind.lower()
  else:
    device = jax.devices()[0] if device is None else device
    if device.platform == "cpu":
      return "cpu" if "cpu" in table else None
    kind = device.device_kind.lower()
  return next((f for f in table if f != "cpu" and f in kind), None)


def resolve_budget(value, device=None) -> int:
  """``memory_budget`` in bytes; ``"auto"``: the ``bytes_limit`` of ``device`` (default:
  the compile target's, :func:`lowmem_jax.gpu_target.bytes_limit`, else the first device's)
  less :data:`AUTO_MARGIN`. ValueError where the device reports no limit (the
  CPU: host memory is shared with everything else on the machine, so give an explicit size
  there)."""
  size = parse_budget(value)
  if size != "auto":
    return size
  if device is None and gpu_target.active() is not None:
    return int(gpu_target.bytes_limit() * (1 - AUTO_MARGIN))
  device = jax.devices()[0] if device is None else device
  stats = device.memory_stats() or {}
  if "bytes_limit" not in stats:
    raise ValueError(f"memory_budget='auto' needs a device that reports its memory limit "
                     f"(memory_stats()['bytes_limit']); {device.platform} does not: give a "
                     f"size, e.g. memory_budget=8GiB")
  return int(stats["bytes_limit"] * (1 - AUTO_MARGIN))


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One plan: a policy and micro-batch, its expected step time and predicted peak."""
  policy: str
  micro_batch: int
  grad_accum: int
  step_time: float            # relative to baseline at the full batch
  speed_from: str             # "table" | "model" (the cost model) | "table+model"
  peak: int | None = None     # predicted peak bytes; None: not compiled
  note: str = ""              # why it was not compiled

  @property
  def speed(self) -> float:
    """Expected speed relative to baseline at the full batch."""
    return 1.0 / self.step_time


def fmt_bytes(n: int) -> str:
  """``n`` bytes, readable at any scale: GiB (2 decimals) from 1 GiB, MiB (1 decimal) from
  0.1 MiB, KiB (1 decimal) from 1 KiB, else bytes; a size that is not zero never reads
  "0.0"."""
  if n >= 2**30:
    return f"{n / 2**30:.2f} GiB"
  if n >= MiB / 10:
    return f"{n / MiB:.1f} MiB"
  return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} bytes"


def _exact(n: int) -> str:
  """``n`` readable and to the byte: ``"20.0 MiB (20971520 bytes)"``, ``"1000 bytes"``."""
  return f"{fmt_bytes(n)} ({n} bytes)" if n >= 2**10 else fmt_bytes(n)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The candidates (fastest first), the chosen one, and how planning went."""
  budget: int
  family: str | None
  candidates: tuple[Candidate, ...]
  chosen: Candidate | None  # None: nothing fits (a table of what was compiled, then an error)
  seconds: float
  # the eval batch that fits the budget beside the state, and that eval's predicted peak
  # (None: eval not planned)
  eval_batch_size: int | None = None
  eval_peak: int | None = None

  @property
  def compiled(self) -> int:
    return sum(c.peak is not None for c in self.candidates)

  def apply(self, cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the chosen policy and grad_accum (the batch size unchanged), and the
    eval batch that fits."""
    eval_batch = {} if self.eval_batch_size is None else {
        "eval_batch_size": self.eval_batch_size}
    return cfg.with_policy(self.chosen.policy, grad_accum=self.chosen.grad_accum,
                           **eval_batch)

  def table(self) -> str:
    def note(c):
      if c is self.chosen:
        return "<- chosen"
      return "over budget" if c.peak is not None and c.peak > self.budget else c.note
    rows = [(c.policy, c.micro_batch, c.grad_accum,
             "-" if c.peak is None else fmt_bytes(c.peak),
             f"{c.speed:.3f} ({c.speed_from})", note(c)) for c in self.candidates]
    return format_table(("policy", "micro-batch", "grad_accum", "predicted peak",
                         "expected speed", "chosen"), rows)

  def summary(self) -> str:
    speeds = (f"speed table '{self.family}'" if self.family else
              "no speed table for this device: the cost model")
    return (f"planner: memory_budget {fmt_bytes(self.budget)}; {self.compiled} of "
            f"{len(self.candidates)} candidates compiled in {self.seconds:.1f} s; {speeds}; "
            f"chosen {self.chosen.policy}, micro-batch {self.chosen.micro_batch} x "
            f"grad_accum {self.chosen.grad_accum}, predicted peak "
            f"{fmt_bytes(self.chosen.peak)}" + ("" if self.eval_peak is None else
            f"; eval_batch_size {self.eval_batch_size}, predicted eval peak "
            f"{fmt_bytes(self.eval_peak)}"))


def _step_time(policy: MemoryPolicy, measured: dict) -> tuple[float, str]:
  """``policy``'s expected step time and where it comes from: the table ("table"); its
  measured base (the policy without recomputes) plus what the cost model adds for them
  ("table+model"); else the cost model alone ("model")."""
  if policy in measured:
    return measured[policy], "table"
  base = dataclasses.replace(policy, qkv="keep", hidden="keep")
  if base in measured:
    return measured[base] + modelled_step_time(policy) - modelled_step_time(base), \
        "table+model"
  return modelled_step_time(policy), "model"


def candidates(cfg: TrainConfig, policies: Sequence[str], table: dict,
               family: str | None) -> list[Candidate]:
  """Every policy x micro-batch dividing ``cfg.batch_size``, fastest first (ties: the order
  of ``policies``, then the larger micro-batch). Each policy is named by its canonical spec
  (as the memory report and the run's config name it); specs that parse to one policy are
  one candidate."""
  entry = table.get(family, {}) if family else {}
  measured = {MemoryPolicy.parse(k): v for k, v in entry.get("step_time", {}).items()}
  penalty = entry.get("micro_batch_penalty")
  # the measured penalty holds up to the largest grad_accum measured; past it, the model's
  measured_up_to = entry.get("micro_batch_penalty_up_to")
  out = []
  for policy in dict.fromkeys(MemoryPolicy.parse(spec) for spec in policies):
    t, t_source = _step_time(policy, measured)
    for micro in sorted((m for m in range(1, cfg.batch_size + 1) if cfg.batch_size % m == 0),
                        reverse=True):
      accum = cfg.batch_size // micro
      known = penalty is not None and (measured_up_to is None or accum <= measured_up_to)
      p = penalty if known else MICRO_BATCH_PENALTY
      source = t_source if accum == 1 or known else "model"
      out.append(Candidate(policy.spec, micro, accum, t * (1 + p * (accum - 1)), source))
  return sorted(out, key=lambda c: c.step_time)  # stable: the ties keep their order


def search(cands: Sequence[Candidate], peak_of: Callable[[Candidate], int],
           budget: int) -> tuple[list[Candidate], Candidate | None]:
  """The fastest of ``cands`` (fastest first) whose peak (``peak_of(c)``: predicted bytes)
  is <= ``budget``, with the few ``peak_of`` calls the module docstring says; the candidates
  with their peaks (or why they were not compiled), and the chosen one or None."""
  peaks: dict[int, int] = {}
  lost: dict[str, int] = {}  # policy -> its smallest micro-batch known not to fit
  best = None  # index into cands

  def fits(i):
    if i not in peaks:
      peaks[i] = peak_of(cands[i])
    if peaks[i] > budget:
      lost[cands[i].policy] = min(lost.get(cands[i].policy, cands[i].micro_batch),
                                  cands[i].micro_batch)
    return peaks[i] <= budget

  for i, c in enumerate(cands):
    if best is not None and c.step_time >= cands[best].step_time:
      break
    if c.micro_batch >= lost.get(c.policy, c.micro_batch + 1):
      continue  # a smaller micro-batch of its policy does not fit
    missed = c.policy in lost
    if fits(i):
      best = i  # every faster candidate is known not to fit
      break
    if missed:  # the policy's second miss: its smallest micro-batch, then bisect
      rest = [j for j in range(i + 1, len(cands)) if cands[j].policy == c.policy
              and (best is None or cands[j].step_time < cands[best].step_time)]
      if not rest or not fits(rest[-1]):
        lost[c.policy] = 0  # not even its smallest (of those left) fits: none will
        continue
      lo, hi = 0, len(rest) - 1  # the first of rest that fits (rest[-1] does)
      while lo < hi:
        mid = (lo + hi) // 2
        if fits(rest[mid]):
          hi = mid
        else:
          lo = mid + 1
      best = rest[hi]  # faster candidates of other policies may still fit: go on

  def note(i, c):
    if best is not None and c.step_time >= cands[best].step_time:
      return "not compiled: no faster than the chosen"
    return "not compiled: a smaller micro-batch of this policy does not fit"
  out = [dataclasses.replace(c, peak=peaks[i]) if i in peaks else
         dataclasses.replace(c, note=note(i, c)) for i, c in enumerate(cands)]
  return out, None if best is None else out[best]


def abstract_trainer(cfg: TrainConfig) -> Trainer:
  """A :class:`Trainer` of ``cfg`` whose state is ShapeDtypeStructs: the model (without
  pretrained weights) and optimizer state are built inside ``jax.eval_shape``, so no
  parameter is materialized."""
  made = {}

  def state():
    made["trainer"] = Trainer.create(cfg, build_model(cfg, load_weights=False))
    return made["trainer"].state
  shapes = jax.eval_shape(state)
  trainer = made["trainer"]
  first_bad = no_bad_step()
  if trainer.mesh is not None:  # eval_shape drops the shardings: the state's, FSDP's
    placed = lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)
    shapes = jax.tree.map(placed, shapes, sharding.state_shardings(shapes, trainer.mesh))
    replicated = jax.sharding.NamedSharding(trainer.mesh, jax.P())
    first_bad = jax.tree.map(lambda x: placed(x, replicated), first_bad)
  return dataclasses.replace(trainer, state=shapes, first_bad=first_bad)


def state_bytes(cfg: TrainConfig) -> int:
  """Bytes of ``cfg``'s train state per device (the parameters, the rest of the model,
  the optimizer state, the step, the non-finite tracker), from the abstract trainer's shapes
  and dtypes: nothing materialized or compiled. A lower bound on the predicted peak of every
  plan of ``cfg.policy``: the state is an argument of the train step (donated) and its new
  value an output, whatever the micro-batch. The batch is left out (``jax.jit`` drops
  arguments the step does not read)."""
  trainer = abstract_trainer(cfg)
  return _bytes((trainer.state, trainer.first_bad))


def _bytes(tree) -> int:
  """Bytes per device of the ShapeDtypeStructs in ``tree``."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    shape = leaf.shape if sharding is None else sharding.shard_shape(leaf.shape)
    total += -(-math.prod(shape) * jax.dtypes.itemsize_bits(leaf.dtype) // 8)
  return total


# (compile target, backend, sha256 of the lowered step) -> its predicted peak: two plans
# whose steps lower to the same program (a policy whose option changes nothing for this
# model: hidden=recompute under lowmem's 2-bit GELU, or with the last linear frozen) are
# compiled once per process
_PEAKS: dict[tuple, int] = {}


def predict_peak(cfg: TrainConfig, batch_shapes: dict) -> int:
  """Predicted peak bytes of ``cfg``'s train step on ``batch_shapes`` (module docstring):
  compiled ahead of time, nothing run; a step that lowers to a program compiled before
  takes that one's peak."""
  lowered = abstract_trainer(cfg).lower(batch_shapes)
  backend = gpu_target.backend()
  target = gpu_target.active()
  key = (None if target is None else target.name, backend,
         hashlib.sha256(lowered.as_text().encode()).hexdigest())
  if key not in _PEAKS:
    options = PLAN_COMPILER_OPTIONS.get(backend, {})
    _PEAKS[key] = compiled_memory(lowered.compile(compiler_options=options)).total
  return _PEAKS[key]


def policies_for(cfg: TrainConfig, policies: Sequence[str] | None = None) -> tuple[str, ...]:
  """The candidate policies for ``cfg``'s model: ``policies`` (default: its kind's,
  :data:`DEFAULT_POLICIES` or :data:`REVERSIBLE_POLICIES`) less those its architecture
  refuses (found by checking each against the model, before any compile); a ValueError
  when none is left."""
  family = model_family(cfg)
  if policies is None:
    policies = REVERSIBLE_POLICIES if family.reversible else DEFAULT_POLICIES

  def runs(spec):
    try:
      MemoryPolicy.parse(spec).check_architecture(family.class_name,
                                                  reversible=family.reversible)
    except ValueError:
      return False
    return True
  kept = tuple(spec for spec in policies if runs(spec))
  if not kept:
    raise ValueError(f"planner: none of the policies {', '.join(policies)} runs on "
                     f"{family.class_name}")
  return kept


def plan(cfg: TrainConfig, batch_example: dict, budget_bytes: int, *,
         policies: Sequence[str] | None = None, table: dict | None = None,
         predict: Callable[[TrainConfig, dict], int] = predict_peak,
         predict_eval: Callable[[TrainConfig, dict], int] | None = None,
         progress: Callable[[str], None] | None = None) -> Plan:
  """The fastest plan (policy, micro-batch) for ``cfg`` whose predicted peak fits
  ``budget_bytes``. ``batch_example``: one global batch (arrays or ShapeDtypeStructs);
  ``policies``: the candidates' policies (default: the model's kind's, :func:`policies_for`);
  ``table``: the speed table (default: train/speed_table.json); ``predict(cfg, shapes)``:
  a plan's peak bytes (default: :func:`predict_peak`); ``predict_eval(cfg, shapes)``: the
  eval step's (:func:`predict_eval_peak`; None: eval not planned), for the chosen plan's
  eval batch (:func:`fit_eval_batch`); ``progress``: told a line per
  candidate compiled (each can take minutes for a large model).
  ValueError naming the budget and the smallest predicted peak when nothing fits; before
  any compile, naming the budget and the least train state of ``policies`` when that alone
  exceeds the budget (:func:`state_bytes`)."""
  start = time.perf_counter()
  policies = policies_for(cfg, policies)
  table = load_speed_table() if table is None else table
  family = device_family(table)
  shapes = {k: jax.ShapeDtypeStruct(np.shape(v), jax.dtypes.canonicalize_dtype(v.dtype))
            for k, v in batch_example.items()}
  if any(s.shape[:1] != (cfg.batch_size,) for s in shapes.values()):
    raise ValueError(f"planner: the batch example's leading sizes "
                     f"{sorted({s.shape[0] for s in shapes.values()})} are not "
                     f"batch_size={cfg.batch_size}")

  states = {}  # policy -> its train state's bytes, until one fits the budget
  for spec in policies:
    states[spec] = state_bytes(cfg.with_policy(spec))
    if states[spec] <= budget_bytes:
      break
  else:
    leanest = min(states, key=states.get)
    raise ValueError(f"memory_budget {_exact(budget_bytes)}: no "
                     f"plan can fit; the train state alone (parameters and optimizer state, "
                     f"held under every plan) is {fmt_bytes(states[leanest])} "
                     f"({states[leanest]} bytes under {leanest}, the least of the policies)")

  cands = candidates(cfg, policies, table, family)
  if progress:
    progress(f"planner: memory_budget {fmt_bytes(budget_bytes)}; {len(cands)} candidate plans, "
             "compiled (nothing run) fastest first until one fits")

  def peak_of(c: Candidate) -> int:
    t0 = time.perf_counter()
    peak = predict(cfg.with_policy(c.policy, grad_accum=c.grad_accum), shapes)
    if progress:
      progress(f"planner: {c.policy}, micro-batch {c.micro_batch} x grad_accum "
               f"{c.grad_accum}: predicted peak {fmt_bytes(peak)}, "
               f"{'fits' if peak <= budget_bytes else 'over budget'} "
               f"({time.perf_counter() - t0:.1f} s)")
    return peak
  rows, chosen = search(cands, peak_of, budget_bytes)
  if chosen is None:
    if progress:  # what the compiles found, before the error
      progress(Plan(budget_bytes, family, tuple(rows), None,
                    time.perf_counter() - start).table())
    least = min((c for c in rows if c.peak is not None), key=lambda c: c.peak)
    raise ValueError(f"memory_budget {_exact(budget_bytes)}: no "
                     f"plan fits; the smallest predicted peak is {fmt_bytes(least.peak)} "
                     f"({least.peak} bytes: {least.policy}, micro-batch {least.micro_batch} "
                     f"x grad_accum {least.grad_accum})")
  eval_batch = eval_peak = None
  if predict_eval is not None:
    eval_batch, eval_peak = fit_eval_batch(
        cfg.with_policy(chosen.policy, grad_accum=chosen.grad_accum), shapes, budget_bytes,
        predict_eval, progress)
  return Plan(budget_bytes, family, tuple(rows), chosen, time.perf_counter() - start,
              eval_batch, eval_peak)


def predict_eval_peak(cfg: TrainConfig, batch_shapes: dict) -> int:
  """Predicted peak bytes while ``cfg``'s eval step runs on ``batch_shapes``: the whole
  train state (live throughout the run) plus the eval step's batch, temporaries and outputs
  (its parameters are the state's); compiled ahead of time, nothing run."""
  trainer = abstract_trainer(cfg)
  weights = (trainer.state["params"], trainer.state["rest"])
  lowered = trainer.eval_step.lower(*gpu_target.place((*weights, batch_shapes)))
  options = PLAN_COMPILER_OPTIONS.get(gpu_target.backend(), {})
  memory = compiled_memory(lowered.compile(compiler_options=options))
  state = _bytes((trainer.state, trainer.first_bad))  # state_bytes(cfg), not built again
  return state + memory.total - _bytes(weights)


def fit_eval_batch(cfg: TrainConfig, shapes: dict, budget: int,
                   predict_eval: Callable[[TrainConfig, dict], int],
                   progress: Callable[[str], None] | None = None) -> tuple[int, int]:
  """``(eval batch, its predicted peak)``: ``cfg.eval_batch_size``, halved (rounded up)
  until ``predict_eval(cfg, shapes)`` fits ``budget`` (the eval batch changes no metric,
  only how many examples run at once; at the full size eval could need several times a
  train step's peak: a vocabulary's logits for every token); a ValueError when one example
  does not fit. ``shapes``: a train batch's (its leading size replaced)."""
  size = cfg.eval_batch_size
  while True:
    eval_shapes = {k: jax.ShapeDtypeStruct((size,) + s.shape[1:], s.dtype)
                   for k, s in shapes.items() if k != "example_id"}
    peak = predict_eval(cfg, eval_shapes)
    if progress:
      progress(f"planner: eval batch {size} under {cfg.policy}: predicted peak "
               f"{fmt_bytes(peak)}, {'fits' if peak <= budget else 'over budget'}")
    if peak <= budget:
      return size, peak
    if size == 1:
      raise ValueError(f"memory_budget {_exact(budget)}: the plan chosen ({cfg.policy}, "
                       f"grad_accum {cfg.grad_accum}) trains within it, but its eval step "
                       f"needs {fmt_bytes(peak)} ({peak} bytes) at eval_batch_size 1")
    size = (size + 1) // 2


def real_peak_report(plan_: Plan) -> dict:
  """After a step: the device's ``peak_bytes_in_use`` against the prediction (error in %
  of the real peak), or a note where the device reports none (the CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  predicted = plan_.chosen.peak
  if "peak_bytes_in_use" not in stats:
    return {"predicted_peak": predicted, "real_peak": None,
            "line": f"planner: the real peak is not available on {jax.default_backend()} "
                    f"(no memory_stats()); predicted {fmt_bytes(predicted)} stands unchecked"}
  real = int(stats["peak_bytes_in_use"])
  error = 100.0 * (predicted - real) / real
  return {"predicted_peak": predicted, "real_peak": real, "error_pct": error,
          "line": f"planner: step 1 peak_bytes_in_use {fmt_bytes(real)}, predicted "
                  f"{fmt_bytes(predicted)} (error {error:+.1f}% of the real peak)"}
