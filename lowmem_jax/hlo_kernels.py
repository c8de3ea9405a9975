"""What a compiled step launches: kernels per step and the bytes its loops copy in and out
of stacked buffers, read off the optimized HLO text (``compiled.as_text()``, parsed by
:class:`lowmem_jax.buffer_assignment.HloText`).

A proxy for speed where no GPU runs, not a timing: each fusion, library call (cuBLAS,
cuDNN) and copy is one kernel launch, counted once per loop iteration (a ``while`` with
a known trip count, as ``lax.scan`` compiles, counts its body that many times). A scan
stacks its per-layer residuals: a fusion that only does a ``dynamic-update-slice`` writes
one layer's slice into the stack, one that only does a ``dynamic-slice`` reads one out;
on XLA:GPU each is a copy (a matmul cannot write into or read from such a slice), and
``stack_copy_bytes`` is what they read plus write per step.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from lowmem_jax.buffer_assignment import HloText, parse_type

# one launch each: what XLA:GPU's thunks run (parameters, tuples, bitcasts run nothing)
LAUNCHES = ("fusion", "custom-call", "copy", "sort", "all-reduce", "reduce-scatter",
            "all-gather", "collective-permute")
# what a fusion that only copies a slice may do besides its slice
_COPY_ONLY = {"parameter", "copy", "bitcast"}


@dataclasses.dataclass(frozen=True)
class Kernels:
  """Per step: kernel launches, stack copies (count and bytes read + written) and the
  trip counts of the loops."""
  launches: int
  stack_copies: int
  stack_copy_bytes: int
  loop_trips: tuple[int, ...]


def count_kernels(hlo_text: str) -> Kernels:
  """:class:`Kernels` of an optimized HLO module's text (``compiled.as_text()``): the
  entry computation, the bodies of its while loops (each counted once per trip), the
  computations that calls and async pairs run (XLA:GPU wraps fusions in them; a call on
  another stream is ``call-start``) and, of a conditional's branches, the one that
  launches most."""
  hlo = HloText(hlo_text)
  if not hlo.entry:
    raise ValueError("count_kernels: no ENTRY computation in the HLO text")
  by_computation: dict[str, list] = {}  # computation -> its instructions, in order
  for instr in hlo.instrs.values():
    by_computation.setdefault(instr.computation, []).append(instr)

  def count(computation: str) -> tuple[int, int, int, list[int]]:
    """(launches, stack copies, their bytes, loop trips) of one run of a computation."""
    launches = copies = copy_bytes = 0
    trips: list[int] = []

    def add(part, times):
      nonlocal launches, copies, copy_bytes
      launches, copies = launches + times * part[0], copies + times * part[1]
      copy_bytes += times * part[2]
      trips.extend(part[3])

    for instr in by_computation.get(computation, ()):
      if instr.opcode == "while":
        trips.append(instr.trip_count or 1)
        add(count(instr.body), trips[-1])
      elif instr.opcode == "async-start" and instr.calls:
        add(count(instr.calls), 1)
      elif instr.opcode == "conditional" and instr.runs:
        add(max((count(c) for c in instr.runs), key=lambda part: part[0]), 1)
      elif instr.runs:
        for called in instr.runs:
          add(count(called), 1)
      if instr.opcode not in LAUNCHES:
        continue
      launches += 1
      kind = _stack_copy(by_computation.get(instr.calls, ())) if instr.opcode == "fusion" \
          else None
      if kind:
        shape, dtype = parse_type(instr.type_text)
        nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize
        # a dynamic-update-slice fusion's output is the whole stack: one layer's slice moved
        moved = nbytes // shape[0] if kind == "dynamic-update-slice" else nbytes
        copies, copy_bytes = copies + 1, copy_bytes + 2 * moved
    return launches, copies, copy_bytes, trips

  launches, copies, copy_bytes, trips = count(hlo.entry)
  return Kernels(launches, copies, copy_bytes, tuple(sorted(trips)))


def async_overlaps(hlo_text: str) -> dict[str, int]:
  """For each asynchronous op of a scheduled HLO module's text that can run beside the
  main stream (an ``*-start`` / ``*-done`` pair put on another GPU stream, or a copy to or
  from the host), how many launches the schedule puts between its start and its done, in
  the same computation. 0: nothing can run beside it (XLA waits for it at once); what
  overlaps is what a second stream or the copy engine can hide. A proxy read off the
  compiled schedule, not a timing. Left out: XLA:GPU 0.11 wraps some fusions (small
  dynamic-update-slices) in async pairs on the main stream (operation queue 0); the
  launches between those run in order with them, whatever their number."""
  hlo = HloText(hlo_text)
  by_computation: dict[str, list] = {}
  for instr in hlo.instrs.values():
    by_computation.setdefault(instr.computation, []).append(instr)
  overlaps = {}
  for instrs in by_computation.values():
    for k, start in enumerate(instrs):
      if not start.opcode.endswith("-start") or (
          start.opcode != "copy-start" and not start.stream):
        continue
      between = 0
      for instr in instrs[k + 1:]:
        if instr.opcode.endswith("-done") and start.name in instr.operands:
          break
        between += instr.opcode in LAUNCHES
      overlaps[start.name] = between
  return overlaps


def _stack_copy(fused: list) -> str | None:
  """"dynamic-slice" / "dynamic-update-slice" for a fused computation that only copies a
  slice out of or into a buffer (its other work: scalar index arithmetic, copies,
  bitcasts); None otherwise."""
  opcodes = {i.opcode for i in fused if not i.type_text.startswith("s32[]")}
  for kind in ("dynamic-slice", "dynamic-update-slice"):
    if kind in opcodes and opcodes <= _COPY_ONLY | {kind}:
      return kind
  return None
