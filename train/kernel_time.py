"""Where a train step's device time goes: the kernels of a device trace, by kind and source.

A step time says how long, not why. Traced (JAX: ``jax.profiler.trace``, read back with
``jax.profiler.ProfileData``; torch: ``torch.profiler`` with CUDA activity), the same steps
give the list of kernels the device ran, each a :class:`Kernel`. :func:`summarize` turns
that list into figures per step, for ours and the peers alike:

* ``wall_ms``: the host's time from the first dispatch to the last result, over the steps;
* ``busy_ms``: the union of all kernels' intervals (every stream): what the device worked;
  ``idle_ms`` = wall - busy is time the device waited (for the host, a launch, a copy);
* ``kind_ms``: kernel time by kind, from the kernel's name alone (so ours and torch's read
  alike): ``matmul`` (cuBLAS, cuBLASLt, CUTLASS, Triton GEMMs, convolutions), ``attention``
  (fused attention kernels: cuDNN, flash, FMHA, SDPA), ``copy`` (memcpy, memset, copies),
  ``other`` (the rest: XLA's elementwise and reduction fusions, torch's elementwise
  kernels, the optimizer). Our own ``"flash"`` attention is XLA fusions and GEMMs, so it
  counts under matmul and other; its source line says where it is;
* ``top``: the kernels' time grouped by where they come from: for JAX, the Python source
  line of the HLO instruction that launched them (``where``, from the compiled step's
  HLO text; for a kernel replayed in a CUDA graph, whose event names the graph's
  ``command_buffer_N`` thunk, the fusion its kernel is named after); else the kernel
  name. ``attributed``: the share of kernel time placed so (without ``where``: the
  share whose trace event names an HLO op).

Kernel times sum above ``busy_ms`` where kernels overlap on several streams. Only the
device's planes count (a trace on CPU has none: :func:`trace_steps` returns None).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable

KINDS = ("matmul", "attention", "copy", "other")
# checked in this order on the kernel's lowercased name: a name with "gemm" and "flash"
# in it (cuDNN's fused attention is built of GEMMs) is attention
_PATTERNS = (
    ("attention", re.compile(r"fmha|flash|sdpa|attention")),
    ("matmul",
     re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul|conv(?!ert)|fprop|dgrad|wgrad")),
    ("copy", re.compile(r"memcpy|memset|copy")),
)
# the device planes' lines that are derived from the streams' (a trace viewer adds them):
# counting them would count each kernel twice
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Framework Ops", "Source code",
                  "TensorFlow Name Scope", "XLA TraceMe")
TOP = 15
PROFILE_STEPS = 5  # steps traced per run (train.bench --profile, the peers'): trace size, time


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel the device ran: its name, the HLO instruction that launched it ("" when
  the trace does not say: torch, or kernels replayed in a CUDA graph), start and
  duration."""
  name: str
  op: str
  start_ns: float
  duration_ns: float


def kind(name: str) -> str:
  """The kernel's kind (:data:`KINDS`) from its name."""
  low = name.lower()
  return next((k for k, pattern in _PATTERNS if pattern.search(low)), "other")


def busy_ns(kernels: Iterable[Kernel]) -> float:
  """The length of the union of the kernels' intervals: time the device had work."""
  total, end = 0.0, float("-inf")
  for k in sorted(kernels, key=lambda k: k.start_ns):
    stop = k.start_ns + k.duration_ns
    if k.start_ns >= end:
      total += k.duration_ns
      end = stop
    elif stop > end:
      total += stop - end
      end = stop
  return total


def one_line(profile: dict) -> str:
  """``device busy B of W ms per step (matmul ..., attention ..., copy ..., other ...)``."""
  kinds = ", ".join(f"{k} {ms:.2f}" for k, ms in profile["kind_ms"].items())
  return (f"device busy {profile['busy_ms']:.2f} of {profile['wall_ms']:.2f} ms per step "
          f"({kinds} ms)")


def summarize(kernels: list[Kernel], steps: int, wall_s: float,
              where: Callable[[str], str] | None = None, top: int = TOP) -> dict:
  """Per-step figures of ``steps`` steps' ``kernels`` (module docstring), ``wall_s`` their
  host time. ``where(op)``: the source of an HLO instruction, for ``top``'s groups."""
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")
  per_step = lambda ns: ns / steps / 1e6  # noqa: E731 - ns over all steps -> ms per step
  by_kind = dict.fromkeys(KINDS, 0.0)
  groups: dict[str, list] = {}
  known = 0.0  # kernel time with a source (where given) or an op (not)
  for k in kernels:
    kk = kind(k.name)
    by_kind[kk] += k.duration_ns
    if where:  # the op's source, else the kernel name's: XLA:GPU replays most kernels in
      # CUDA graphs, whose trace events name the graph's thunk (command_buffer_N) as op
      source = (k.op and where(k.op)) or where(k.name)
      label = source or k.name
    else:
      source = k.op
      label = k.op or k.name
    known += k.duration_ns if source else 0.0
    g = groups.setdefault(label, [0.0, 0, {}])
    g[0] += k.duration_ns
    g[1] += 1
    g[2][kk] = g[2].get(kk, 0.0) + k.duration_ns
  busy = busy_ns(kernels)
  wall_ns = wall_s * 1e9
  ranked = sorted(groups.items(), key=lambda item: -item[1][0])[:top]
  return {
      "steps": steps, "wall_ms": per_step(wall_ns), "busy_ms": per_step(busy),
      "idle_ms": per_step(max(wall_ns - busy, 0.0)),
      "kernels_per_step": len(kernels) / steps,
      "kernel_ms": per_step(sum(k.duration_ns for k in kernels)),
      "kind_ms": {kk: per_step(ns) for kk, ns in by_kind.items()},
      "attributed": known / max(sum(k.duration_ns for k in kernels), 1.0),
      "top": [{"where": label, "ms": per_step(ns), "kernels": n / steps,
               "kind": max(kinds, key=kinds.get)}
              for label, (ns, n, kinds) in ranked],
  }


# ----------------------------------------------------------------------------- JAX
def xspace_kernels(path: str) -> list[Kernel]:
  """The device kernels of a ``jax.profiler`` trace file (``*.xplane.pb``): every event on
  the stream lines of the ``/device:`` planes, with its ``hlo_op``."""
  from jax.profiler import ProfileData
  return kernels_of(ProfileData.from_file(path))


def kernels_of(profile) -> list[Kernel]:
  """:func:`xspace_kernels` of a ``jax.profiler.ProfileData``."""
  kernels = []
  for plane in profile.planes:
    if not plane.name.startswith("/device:"):
      continue
    lines = [line for line in plane.lines if line.name not in _DERIVED_LINES]
    streams = [line for line in lines if line.name.startswith("Stream")]
    seen = set()  # an event on two lines (a viewer's copy under another name) counts once
    for line in streams or lines:
      for event in line.events:
        key = (event.name, event.start_ns, event.duration_ns)
        if key in seen:
          continue
        seen.add(key)
        stats = dict(event.stats)
        kernels.append(Kernel(event.name, str(stats.get("hlo_op", "") or ""),
                              float(event.start_ns), float(event.duration_ns)))
  return kernels


def trace_steps(run: Callable[[], object], steps: int,
                where: Callable[[str], str] | None = None) -> dict | None:
  """:func:`summarize` of ``run()`` (which dispatches ``steps`` steps and returns what to
  wait for) under ``jax.profiler.trace``; None when the trace holds no device kernels
  (a CPU backend)."""
  import jax
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      start = time.perf_counter()
      jax.block_until_ready(run())
      wall = time.perf_counter() - start
    kernels = read_trace(folder)
  if not kernels:
    return None
  return summarize(kernels, steps, wall, where)


def read_trace(folder: str) -> list[Kernel]:
  """The device kernels of the newest trace under ``folder`` (``jax.profiler`` writes
  each trace to ``plugins/profile/<time>/``, one ``*.xplane.pb`` per host): [] when there
  is none, or it holds no device plane."""
  files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
  if not files:
    return []
  newest = os.path.dirname(max(files, key=os.path.getmtime))
  return [k for f in sorted(files) if os.path.dirname(f) == newest
          for k in xspace_kernels(f)]


def hlo_sources(hlo_text: str) -> Callable[[str], str]:
  """``op -> "file:line (function) [phase]"`` for the instructions of a compiled module's
  HLO text (``compiled.as_text()``); "" for an op it does not hold. ``op`` may also be a
  kernel's name: XLA names the kernel it emits for a fusion after the fusion, ``.`` and
  ``-`` made ``_`` (``loop_add_fusion_1``), which is how a kernel replayed in a CUDA graph,
  whose trace event carries no ``hlo_op``, is still placed. The phase, from JAX's op name:
  ``fwd``, ``bwd`` (under ``transpose``), ``+recompute`` (a rematted forward); none for an
  instruction without one (XLA's own)."""
  from lowmem_jax.buffer_assignment import HloText
  hlo = HloText(hlo_text)
  by_kernel_name = {re.sub(r"[.\-]", "_", name): name for name in hlo.instrs}

  def where(op: str) -> str:
    instr = hlo.instrs.get(op) or hlo.instrs.get(by_kernel_name.get(op, ""))
    if instr is None:
      return ""
    if not instr.op_name:  # one XLA made (0.11: a broadcast): its phase is not known
      return hlo.source(instr)
    phase = "bwd" if "transpose(" in instr.op_name else "fwd"
    phase += "+recompute" if "rematted_computation" in instr.op_name else ""
    return f"{hlo.source(instr)} [{phase}]"
  return where


# ----------------------------------------------------------------------------- torch
def torch_kernels(events) -> list[Kernel]:
  """The CUDA kernels (and copies) of ``torch.profiler``'s ``prof.events()``."""
  kernels = []
  for e in events:
    if str(getattr(e, "device_type", "")).rsplit(".", 1)[-1] != "CUDA":
      continue
    start_us, end_us = e.time_range.start, e.time_range.end
    kernels.append(Kernel(e.name, "", start_us * 1e3, (end_us - start_us) * 1e3))
  return kernels


# ----------------------------------------------------------------------------- tables
def table(profiles: dict[str, dict]) -> str:
  """One row per traced run: wall, busy and idle ms per step and kernel ms by kind."""
  from lowmem_jax.memory import format_table
  headers = ["run", "wall ms", "busy ms", "idle ms", *[f"{k} ms" for k in KINDS],
             "kernels/step", "attributed"]
  rows = [[name, f"{p['wall_ms']:.2f}", f"{p['busy_ms']:.2f}", f"{p['idle_ms']:.2f}",
           *[f"{p['kind_ms'][k]:.2f}" for k in KINDS], f"{p['kernels_per_step']:.0f}",
           f"{p['attributed']:.0%}"] for name, p in profiles.items()]
  return format_table(headers, rows)


def top_table(name: str, profile: dict) -> str:
  """``profile``'s ``top`` groups: ms per step, kernels per step, main kind, where."""
  out = [f"{name}: device time by source (ms per step)"]
  for t in profile["top"]:
    out.append(f"  {t['ms']:8.3f}  {t['kernels']:6.1f}  {t['kind']:<9}  {t['where']}")
  return "\n".join(out)
