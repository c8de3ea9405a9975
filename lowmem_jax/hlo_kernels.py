"""What a compiled step launches: kernels per step and the bytes its loops copy in and out
of stacked buffers, read off the optimized HLO text (``compiled.as_text()``).

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
import re

# one launch each: what XLA:GPU's thunks run (parameters, tuples, bitcasts run nothing)
LAUNCHES = ("fusion", "custom-call", "copy", "sort", "all-reduce", "reduce-scatter",
            "all-gather", "collective-permute")
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "f8e4m3fn": 1, "f8e5m2": 1,
               "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8}
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = (\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?|"
                          r"\w+\[\]) ([\w\-]+)\(")


@dataclasses.dataclass(frozen=True)
class Kernels:
  """Per step: kernel launches, stack copies (count and bytes read + written) and the
  trip counts of the loops."""
  launches: int
  stack_copies: int
  stack_copy_bytes: int
  loop_trips: tuple[int, ...]

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def count_kernels(hlo_text: str) -> Kernels:
  """:class:`Kernels` of an optimized HLO module's text (``compiled.as_text()``)."""
  computations, entry = _computations(hlo_text)
  launches = copies = copy_bytes = 0
  trips: list[int] = []
  stack = [(entry, 1)]
  while stack:
    name, times = stack.pop()
    for line in computations.get(name, ()):
      m = _INSTRUCTION.match(line)
      if not m:
        continue
      shape, opcode = m.groups()
      if opcode == "while":
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        n = int(trip.group(1)) if trip else 1
        trips.append(n)
        stack.append((re.search(r"body=%?([\w.\-]+)", line).group(1), times * n))
      elif opcode in ("call", "conditional", "async-start"):
        stack += [(c, times) for c in re.findall(r"(?:to_apply|calls|branch_computations=\{?|"
                                                  r"true_computation|false_computation)"
                                                  r"=?%?([\w.\-]+)", line)]
      if opcode not in LAUNCHES:
        continue
      launches += times
      root = _stack_copy(computations, line) if opcode == "fusion" else None
      if root == "dynamic-slice":
        copies, copy_bytes = copies + times, copy_bytes + times * 2 * _bytes(shape)
      elif root == "dynamic-update-slice":  # the update: one slice of the stacked output
        lead = int(re.match(r"\w+\[(\d+)", shape).group(1)) if "[" in shape else 1
        copies += times
        copy_bytes += times * 2 * _bytes(shape) // max(lead, 1)
  return Kernels(launches, copies, copy_bytes, tuple(sorted(trips)))


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  computations: dict[str, list[str]] = {}
  entry, current = "", None
  for line in text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      head = line.split()
      current = (head[1] if head[0] == "ENTRY" else head[0]).lstrip("%")
      entry = current if head[0] == "ENTRY" else entry
      computations[current] = []
    elif current is not None and line.startswith(" "):
      computations[current].append(line)
  if not entry:
    raise ValueError("count_kernels: no ENTRY computation in the HLO text")
  return computations, entry


def _stack_copy(computations, line: str) -> str | None:
  """"dynamic-slice" / "dynamic-update-slice" for a fusion that only copies a slice out
  of or into a buffer (its other work: scalar index arithmetic, copies, bitcasts)."""
  called = re.search(r"calls=%?([\w.\-]+)", line)
  opcodes = set()
  for body_line in computations.get(called.group(1), ()) if called else ():
    m = _INSTRUCTION.match(body_line)
    if m and not m.group(1).startswith("s32[]"):
      opcodes.add(m.group(2))
  for kind in ("dynamic-slice", "dynamic-update-slice"):
    if kind in opcodes and opcodes <= {kind, "parameter", "copy", "bitcast"}:
      return kind
  return None


def _bytes(shape: str) -> int:
  total = 0
  for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
    total += _ITEM_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
  return total
