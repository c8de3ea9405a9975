"""What the compiled executable keeps live at its memory peak, read off XLA's own dumps.

:func:`peak_buffers` compiles a function with ``xla_dump_to`` set for that one compile and
reads three files XLA writes after buffer assignment (CPU and GPU alike):

* ``*after_optimizations-live-range.txt``: the schedule and each value's live range;
* ``*after_optimizations-buffer-assignment.txt``: each value's size, shape, allocation
  (argument, output, temporary) and offset in it;
* ``*after_optimizations.txt``: the optimized HLO, whose op metadata names the JAX op and the
  Python source line of every instruction.

The peak is the moment of the schedule with the most distinct *device* bytes live (values
in another memory space, offload's pinned host memory, are not counted): values that
share bytes (a loop's state and its in-place update, a bitcast, a donated argument and
the output written into it) are counted once, each at its own size from the buffer
assignment. XLA's own "Live ranges at T (peak)" list is not used: it sizes values by
their defining instruction's shape (a while loop's tuple elements at a pointer's 8
bytes) and counts aliases twice, so under Mesa, whose codes are all a scan's stacked
residuals, it lands on a forward moment and misses the backward's peak.

A buffer written by a fused ``dynamic-update-slice`` (a ``lax.scan`` stacking a residual
per layer) is attributed to the value it stacks, not to the scan. Jaxpr-level residuals
(:func:`lowmem_jax.memory.saved_residuals`) say what autodiff asks to keep; this says what
the compiler keeps, after fusion and rematerialisation: use this to decide memory claims.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import math
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from lowmem_jax import gpu_target

# HLO element types -> numpy dtype names
_DTYPES = {"f64": "float64", "f32": "float32", "bf16": "bfloat16", "f16": "float16",
           "s64": "int64", "s32": "int32", "s16": "int16", "s8": "int8", "u64": "uint64",
           "u32": "uint32", "u16": "uint16", "u8": "uint8", "pred": "bool",
           "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2", "s4": "int4", "u4": "uint4"}
# ops that only move or relabel their first operand: a buffer they write holds its value
_FORWARDING = {"bitcast", "copy", "reshape", "transpose", "dynamic-update-slice",
               "get-tuple-element"}
# ops whose called computation (``calls=``) takes their operands as its parameters
_CALLERS = ("fusion", "async-start")


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One buffer live at the peak."""
  name: str          # the HLO value ("fusion.3", "while.2{4}")
  nbytes: int
  shape: tuple[int, ...] | None  # None for a tuple (its index table)
  dtype: str | None
  kind: str          # "argument", "output", "temp", "constant"
  instruction: str   # opcode of the producing HLO instruction (a fusion's root op)
  op_name: str       # JAX's op path: "jit(step)/transpose(jvp())/dot_general"
  source: str        # "file.py:123 (function)" of the op's innermost Python frame

  @property
  def type(self) -> str:
    return "tuple" if self.shape is None else f"{self.dtype}{list(self.shape)}"


@dataclasses.dataclass(frozen=True)
class PeakBuffers:
  """The buffers live at the executable's peak, largest first."""
  peak_bytes: int              # the sum of their sizes: the most distinct bytes live
  buffers: tuple[Buffer, ...]
  module: str                  # the HLO module name
  dump_dir: str | None = None  # where the dump was kept (None: removed)
  top: int = 20                # how many buffers and lines table() shows

  def find(self, *, shape: Sequence[int] | None = None, dtype=None,
           kind: str | None = None) -> list[Buffer]:
    """The live buffers of this shape / dtype ("bfloat16" or jnp.bfloat16) / kind (any of
    them left None: any)."""
    dtype = None if dtype is None else np.dtype(dtype).name
    return [b for b in self.buffers
            if (shape is None or b.shape == tuple(shape))
            and (dtype is None or b.dtype == dtype)
            and (kind is None or b.kind == kind)]

  def bytes_of(self, kind: str) -> int:
    return sum(b.nbytes for b in self.buffers if b.kind == kind)

  def by_source(self) -> list[tuple[str, int, int]]:
    """(source line, bytes, buffer count) per Python source line, largest first."""
    acc: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for b in self.buffers:
      acc[b.source][0] += b.nbytes
      acc[b.source][1] += 1
    return sorted(((s, n, c) for s, (n, c) in acc.items()), key=lambda r: -r[1])

  def table(self, top: int | None = None) -> str:
    """The ``top`` buffers, then the bytes per source line (also ``top`` lines)."""
    from lowmem_jax.memory import format_table
    mib, top = 2 ** 20, self.top if top is None else top
    rows = [(b.type, f"{b.nbytes / mib:.2f}", b.kind, b.instruction, b.source)
            for b in self.buffers[:top]]
    rest = self.buffers[top:]
    if rest:
      rows.append((f"{len(rest)} more", f"{sum(b.nbytes for b in rest) / mib:.2f}", "", "", ""))
    kinds = ", ".join(f"{k} {self.bytes_of(k) / mib:.1f}"
                      for k in ("argument", "output", "temp", "constant") if self.bytes_of(k))
    head = (f"live at the peak of {self.module}: {self.peak_bytes / mib:.1f} MiB in "
            f"{len(self.buffers)} buffers ({kinds} MiB)")
    sources = [(s, f"{n / mib:.2f}", c) for s, n, c in self.by_source()[:top]]
    return "\n".join([head, format_table(("buffer", "MiB", "kind", "instruction", "source"),
                                         rows),
                      "", "by source line:",
                      format_table(("source", "MiB", "buffers"), sources)])


def peak_buffers(fn: Callable, *args, top: int = 20, keep_dump: str | None = None,
                 **kwargs) -> PeakBuffers:
  """The buffers live at the peak of ``jax.jit(fn)(*args, **kwargs)``'s executable.

  ``fn`` may be jitted already (its own donation and static arguments apply). Arguments
  may be arrays or ``jax.ShapeDtypeStruct``: nothing runs. Under
  :func:`lowmem_jax.gpu_target.compiling_for` the executable is XLA:GPU's for that target.
  ``top``: how many buffers and source lines :meth:`PeakBuffers.table` shows (all are kept).
  ``keep_dump``: write the XLA dump there and keep it (default: a temporary folder, removed).
  The persistent compilation cache is bypassed for this compile (a cached executable writes
  no dump).
  """
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  lowered = jitted.lower(*gpu_target.place(args), **gpu_target.place(kwargs))
  with tempfile.TemporaryDirectory(prefix="lowmem-xla-dump-") as tmp:
    with no_persistent_cache():  # an empty folder: nothing older in it is read
      lowered.compile(compiler_options={"xla_dump_to": tmp})
    result = read_dump(tmp)
    if keep_dump:
      shutil.copytree(tmp, keep_dump, dirs_exist_ok=True)
  return dataclasses.replace(result, dump_dir=keep_dump, top=top)


@contextlib.contextmanager
def no_persistent_cache():
  """Compiles inside skip the persistent compilation cache (the dump key ignores
  ``xla_dump_to``: a cache hit would write nothing). JAX decides once per process whether
  the cache is used; ``reset_cache`` makes it decide again, before and after."""
  from jax.experimental.compilation_cache import compilation_cache
  global _cache_users, _cache_enabled
  with _cache_lock:  # threads: the first in turns it off, the last out back on
    if _cache_users == 0:
      _cache_enabled = jax.config.jax_enable_compilation_cache
      jax.config.update("jax_enable_compilation_cache", False)
      compilation_cache.reset_cache()
    _cache_users += 1
  try:
    yield
  finally:
    with _cache_lock:
      _cache_users -= 1
      if _cache_users == 0:
        jax.config.update("jax_enable_compilation_cache", _cache_enabled)
        compilation_cache.reset_cache()


_cache_lock = threading.Lock()
_cache_users, _cache_enabled = 0, False


# ----------------------------------------------------------------------------- the dump
def read_dump(folder: str) -> PeakBuffers:
  """:class:`PeakBuffers` from an XLA dump folder (the last module written into it: module
  ids restart in each process, so not the last name)."""
  found = sorted(glob.glob(os.path.join(folder, "*after_optimizations-buffer-assignment.txt")),
                 key=lambda path: (os.path.getmtime(path), path))
  if not found:
    raise FileNotFoundError(f"{folder}: no *after_optimizations-buffer-assignment.txt (was "
                            "the executable compiled with xla_dump_to, not loaded from a cache?)")
  prefix = found[-1][:-len("-buffer-assignment.txt")]
  hlo = HloText(_read(prefix + ".txt"))
  values = _buffer_values(_read(prefix + "-buffer-assignment.txt"))
  live_range = prefix + "-live-range.txt"
  if not os.path.exists(live_range):
    raise FileNotFoundError(f"{live_range}: XLA wrote no live ranges for this module")
  buffers = []
  for name, nbytes in _peak_live(_read(live_range), values):
    value = values[name]
    shape, dtype = parse_type(value.type_text)
    base, _, index = name.partition("{")
    instr = hlo.origin(base, [int(i) for i in index.rstrip("}").split(",") if i])
    buffers.append(Buffer(name=name, nbytes=nbytes, shape=shape, dtype=dtype, kind=value.kind,
                          instruction=instr.root_opcode if instr else "?",
                          op_name=instr.op_name if instr else "",
                          source=hlo.source(instr) if instr else base))
  buffers.sort(key=lambda b: (-b.nbytes, b.name))
  return PeakBuffers(peak_bytes=sum(b.nbytes for b in buffers), buffers=tuple(buffers),
                     module=hlo.module)


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def parse_type(text: str | None):
  """``(shape, dtype name)`` of an HLO array type ("bf16[64,197]{1,0}"); (None, None)
  for anything else (a tuple type)."""
  m = re.fullmatch(r"(\w+)\[([\d,]*)\](?:\{.*\})?", text or "")
  if not m:
    return None, None
  shape = tuple(int(d) for d in m.group(2).split(",") if d)
  return shape, _DTYPES.get(m.group(1), m.group(1))


_ALLOCATION = re.compile(r"^allocation (\d+): size \d+(.*):$")
_VALUE = re.compile(r"^ value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")


@dataclasses.dataclass(frozen=True)
class _Value:
  """Where one HLO value lives: its allocation, offset and size in it."""
  kind: str           # the allocation's: "argument", "output", "temp", "constant", or
                      # "host" (another memory space: pinned host memory, offload's)
  type_text: str      # "f32[6,512,32]{2,1,0}"
  allocation: int
  offset: int
  size: int


def _buffer_values(text: str) -> dict[str, _Value]:
  """value name (``name{index}``) -> where it lives."""
  out, kind, allocation = {}, "temp", -1
  for line in text.splitlines():
    m = _ALLOCATION.match(line)
    if m:
      allocation, kind = int(m.group(1)), _allocation_kind(m.group(2))
      continue
    m = _VALUE.match(line)
    if m:
      name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
      out.setdefault(name, _Value(kind=kind, type_text=m.group(4).strip(),
                                  allocation=allocation, offset=int(m.group(3)),
                                  size=int(m.group(2))))
  return out


def _allocation_kind(attrs: str) -> str:
  """An allocation's kind from its header's attributes, in any order: CPU writes
  ", parameter 0, shape |f32[8]| at ShapeIndex {}", XLA:GPU (0.11) ", page 0, parameter 0, ..."
  (and ", color 5, ..." for another memory space: pinned host memory, not device)."""
  fields = [f.strip() for f in re.sub(r"\|[^|]*\|", "||", attrs).split(",")]
  color = next((f.split()[1] for f in fields if re.fullmatch(r"color \d+", f)), "0")
  if color != "0":
    return "host"
  if any(re.match(r"parameter \d+$", f) for f in fields):
    return "argument"  # a donated argument is also the output: its bytes are the argument's
  if any(f.startswith("output shape is") or f == "maybe-live-out" for f in fields):
    return "output"  # a tuple output's elements: "maybe-live-out" alone (XLA:CPU 0.10)
  return "constant" if "constant" in fields else "temp"


_RANGE = re.compile(r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$")


def _peak_live(text: str, values: dict[str, _Value]) -> list[tuple[str, int]]:
  """(value, bytes) live at the moment with the most distinct bytes live.

  Values at the same allocation and offset are the same bytes (aliases: a loop's state
  and its in-place update, a bitcast, a donated argument and its output): such a slot
  counts once, at the size of its largest live value, and is listed once (that value).
  Live ranges are inclusive schedule positions, nested computations included.
  """
  ranges = [(m.group(1), int(m.group(2)), int(m.group(3)))
            for m in map(_RANGE.match, text.splitlines()) if m]
  ranges = [r for r in ranges
            if r[0] in values and values[r[0]].size and values[r[0]].kind != "host"]
  starts, ends = collections.defaultdict(list), collections.defaultdict(list)
  for name, start, end in ranges:
    starts[start].append(name)
    ends[end + 1].append(name)
  slots: dict[tuple[int, int], collections.Counter] = collections.defaultdict(
      collections.Counter)   # (allocation, offset) -> sizes of its live values
  level, best, best_t = 0, -1, 0

  def change(name: str, delta: int) -> None:
    nonlocal level
    v = values[name]
    sizes = slots[(v.allocation, v.offset)]
    level -= max(sizes, default=0)
    sizes[v.size] += delta
    if not sizes[v.size]:
      del sizes[v.size]
    level += max(sizes, default=0)

  for t in sorted(set(starts) | set(ends)):
    for name in ends.get(t, ()):
      change(name, -1)
    for name in starts.get(t, ()):
      change(name, +1)
    if level > best:
      best, best_t = level, t
  chosen: dict[tuple[int, int], tuple[str, int, int]] = {}
  for name, start, end in ranges:
    if start <= best_t <= end:
      v = values[name]
      key, mine = (v.allocation, v.offset), (name, v.size, start)
      held = chosen.get(key)
      # the largest value of a slot; among equals the one defined first (the original)
      if held is None or (v.size, -start) > (held[1], -held[2]):
        chosen[key] = mine
  return [(name, size) for name, size, _ in chosen.values()]


# ----------------------------------------------------------------------------- HLO text
@dataclasses.dataclass
class _Instr:
  name: str
  opcode: str
  operands: list[str]
  calls: str | None
  body: str | None           # a while loop's body computation
  condition: str | None      # ... and its condition
  index: int | None          # a get-tuple-element's index
  op_name: str
  frame: int | None          # stack_frame_id
  source_file: str | None    # older dumps: source_file / source_line in the metadata
  source_line: int | None
  computation: str
  type_text: str = ""        # "bf16[64,197,768]{2,1,0}", or a tuple type
  trip_count: int | None = None  # a while loop's known trip count
  root_opcode: str = ""
  stream: int | None = None  # the GPU stream it is put on (JAX's stream annotation or
                             # XLA:GPU's operation queue); None: not said (the main one)
  runs: tuple[str, ...] = ()  # computations it runs as they are, not fused or applied per
                              # element: a call's (``to_apply``), a conditional's branches


class HloText:
  """The instructions of an optimized HLO module's text, with their source lines."""
  _HEADER = re.compile(r"^(?:ENTRY )?%?(\S+) .*\{$")
  _INSTR = re.compile(r"^\s+(ROOT )?%?(\S+) = (.*)$")

  def __init__(self, text: str):
    self.module = ""
    self.entry = ""                           # the ENTRY computation
    self.instrs: dict[str, _Instr] = {}       # in the text's order
    self.roots: dict[str, str] = {}          # computation -> root instruction
    self.params: dict[str, list[str]] = {}   # computation -> parameter names by number
    self.files: dict[int, str] = {}
    self.functions: dict[int, str] = {}
    self.locations: dict[int, tuple[int, int, int]] = {}  # id -> (file, function, line)
    self.frames: dict[int, int] = {}         # frame id -> location id
    table, computation = None, None
    for line in text.splitlines():
      if line.startswith("HloModule "):
        self.module = line.split()[1].rstrip(",")
        continue
      if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
        table = line
        continue
      if table and line and line[0].isdigit():
        self._table_row(table, line)
        continue
      table = None
      m = self._HEADER.match(line)
      if m and not line.startswith(" "):
        computation = m.group(1)
        self.entry = computation if line.startswith("ENTRY ") else self.entry
        self.params[computation] = []
        continue
      m = self._INSTR.match(line)
      if m and computation:
        instr = self._instr(m.group(2), m.group(3), computation)
        self.instrs[instr.name] = instr
        if m.group(1):
          self.roots[computation] = instr.name
        if instr.opcode == "parameter":
          num = re.search(r"parameter\((\d+)\)", m.group(3))
          plist = self.params[computation]
          k = int(num.group(1)) if num else len(plist)
          plist.extend([""] * (k + 1 - len(plist)))
          plist[k] = instr.name
    for instr in self.instrs.values():
      instr.root_opcode = self._root(instr).opcode

  def _table_row(self, table: str, line: str) -> None:
    key, _, rest = line.partition(" ")
    key = int(key)
    if table == "FileNames":
      self.files[key] = _unescape(rest.strip().strip('"'))
    elif table == "FunctionNames":
      self.functions[key] = _unescape(rest.strip().strip('"'))
    elif table == "FileLocations":
      f = dict(re.findall(r"(\w+)=(-?\d+)", rest))
      self.locations[key] = (int(f.get("file_name_id", 0)), int(f.get("function_name_id", 0)),
                             int(f.get("line", 0)))
    else:
      f = dict(re.findall(r"(\w+)=(-?\d+)", rest))
      self.frames[key] = int(f.get("file_location_id", 0))

  @staticmethod
  def _instr(name: str, rhs: str, computation: str) -> _Instr:
    # rhs: "<type> <opcode>(<operands>), attr=..., metadata={...}"
    if rhs.startswith("("):  # a tuple type: skip to its closing parenthesis
      depth, i = 0, 0
      for i, ch in enumerate(rhs):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
          break
      type_text, rest = rhs[:i + 1], rhs[i + 1:].lstrip()
    else:
      type_text, _, rest = rhs.partition(" ")
    opcode = rest.split("(", 1)[0].strip()
    depth, args = 0, ""
    for j, ch in enumerate(rest[len(opcode):]):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        args = rest[len(opcode) + 1:len(opcode) + j]
        break
    operands = re.findall(r"%([\w.\-]+)", args)
    calls = re.search(r"calls=%?([\w.\-]+)", rest)
    body = re.search(r"body=%?([\w.\-]+)", rest)
    condition = re.search(r"condition=%?([\w.\-]+)", rest)
    index = re.search(r"index=(\d+)", rest)
    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
    runs = ()
    if opcode in ("call", "call-start"):
      runs = tuple(re.findall(r"to_apply=%?([\w.\-]+)", rest))
    elif opcode == "conditional":
      branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
      runs = tuple(re.findall(r"%?([\w.\-]+)", branches.group(1))) if branches else tuple(
          m.group(1) for m in re.finditer(r"(?:true|false)_computation=%?([\w.\-]+)", rest))
    stream = (re.search(r'_xla_stream_annotation="(\d+)"', rest)
              or re.search(r'"operation_queue_id":"(\d+)"', rest))
    op_name = _quoted("op_name", rest)
    frame = re.search(r"stack_frame_id=(\d+)", rest)
    src_file = _quoted("source_file", rest)
    src_line = re.search(r"source_line=(\d+)", rest)
    return _Instr(name=name, opcode=opcode, operands=operands,
                  calls=calls.group(1) if calls else None,
                  body=body.group(1) if body else None,
                  condition=condition.group(1) if condition else None,
                  index=int(index.group(1)) if index else None,
                  op_name=op_name or "",
                  frame=int(frame.group(1)) if frame else None,
                  source_file=src_file,
                  source_line=int(src_line.group(1)) if src_line else None,
                  computation=computation, type_text=type_text,
                  trip_count=int(trips.group(1)) if trips else None,
                  stream=int(stream.group(1)) if stream else None, runs=runs)

  def _root(self, instr: _Instr) -> _Instr:
    """A fusion's root instruction, an async op's (XLA:GPU wraps fusions in async-start /
    async-done pairs) that of the computation it runs; the instruction itself otherwise."""
    for _ in range(16):
      called = (self._async_start(instr) if instr.opcode == "async-done" else
                instr if instr.opcode == "fusion" else None)
      if called is None or called.calls not in self.roots:
        break
      instr = self.instrs[self.roots[called.calls]]
    return instr

  def _async_start(self, done: _Instr) -> _Instr | None:
    """The async-start of an async-done (through any async-updates)."""
    instr = done
    for _ in range(16):
      instr = self.instrs.get(instr.operands[0]) if instr.operands else None
      if instr is None or instr.opcode != "async-update":
        break
    return instr if instr is not None and instr.opcode == "async-start" else None

  def origin(self, name: str, index: Sequence[int] = ()) -> _Instr | None:
    """The instruction whose value a buffer holds: through fusions, async ops, copies,
    bitcasts and dynamic-update-slices (a scan stacking a residual) to the op that
    computed it.
    ``index``: the tuple element of ``name``'s value (a loop's state)."""
    instr = self.instrs.get(name)
    if instr is not None and len(index) == 1:
      instr = self._tuple_element(instr, index[0]) or instr
    for _ in range(32):
      if instr is None:
        return None
      inner = self._root(instr)
      if inner.opcode == "get-tuple-element" and inner.operands:
        nxt = self._element(self.instrs.get(inner.operands[0]), inner.index or 0)
      elif inner.opcode == "dynamic-update-slice" and len(inner.operands) > 1:
        nxt = self._resolve(inner, inner.operands[1])
      elif inner.operands and ((inner.opcode in _FORWARDING and inner is not instr)
                               or _inserted(inner)):
        nxt = self._resolve(inner, inner.operands[0])
      else:
        return instr if inner is instr else _with_outer(inner, instr)
      if nxt is None:
        return instr
      instr = nxt
    return instr

  def _tuple_element(self, instr: _Instr, k: int) -> _Instr | None:
    """Element ``k`` of a loop's state: a while result, or the parameter of its body or
    condition (which enters as the while's operand)."""
    if instr.opcode == "parameter":
      loops = [i for i in self.instrs.values() if i.opcode == "while"
               and instr.computation in (i.body, i.condition)]
      if not loops:
        return None
      instr = loops[0]
    if instr.opcode != "while":
      return self._element(instr, k)
    # what the body writes into slot k; a slot it only passes on holds the initial value
    written = self._element(instr, k)
    if written is None or (written.opcode == "get-tuple-element"
                           and self.instrs.get(written.operands[0], written).opcode
                           == "parameter"):
      return self._element(self.instrs.get(instr.operands[0]) if instr.operands else None, k)
    return written

  def _element(self, tup: _Instr | None, k: int) -> _Instr | None:
    """Element ``k`` of a tuple or of a while loop's result (its body's root tuple)."""
    if tup is not None and tup.opcode == "while" and tup.body in self.roots:
      tup = self.instrs.get(self.roots[tup.body])
    if tup is not None and tup.opcode == "tuple" and k < len(tup.operands):
      return self.instrs.get(tup.operands[k])
    return None

  def _resolve(self, inner: _Instr, operand: str) -> _Instr | None:
    """``operand`` of ``inner``, followed out of its fusion to the caller's operand when it
    is a fused computation's parameter, and through forwarding ops inside the fusion."""
    cur = self.instrs.get(operand)
    for _ in range(32):
      if cur is None:
        return None
      if cur.opcode == "parameter":
        callers = [i for i in self.instrs.values()
                   if i.opcode in _CALLERS and i.calls == cur.computation]
        params = self.params.get(cur.computation, [])
        if not callers or cur.name not in params:
          return cur
        k = params.index(cur.name)
        outer = callers[0].operands[k] if k < len(callers[0].operands) else None
        cur = self.instrs.get(outer) if outer else None
        if cur is None or cur.opcode != "parameter":
          return cur
        continue  # a fusion's parameter inside an async computation: out once more
      if cur.opcode in ("bitcast", "copy", "reshape", "convert") and cur.operands \
          and cur.computation == inner.computation:
        if cur.opcode == "convert":
          return cur
        cur = self.instrs.get(cur.operands[0])
        continue
      return cur
    return cur

  def source(self, instr: _Instr) -> str:
    """``file:line (function)`` of the instruction's innermost Python frame."""
    if instr.frame is not None and instr.frame in self.frames:
      file_id, fn_id, line = self.locations.get(self.frames[instr.frame], (0, 0, 0))
      return f"{_short(self.files.get(file_id, '?'))}:{line} ({self.functions.get(fn_id, '?')})"
    if instr.source_file:
      return f"{_short(instr.source_file)}:{instr.source_line}"
    return instr.op_name.rsplit("/", 1)[-1] or instr.name


def _unescape(text: str) -> str:
  """An HLO text string as written in Python (HLO writes ``p['w']`` as ``p[\\'w\\']``)."""
  return re.sub(r"\\(.)", r"\1", text)


def _quoted(key: str, text: str) -> str | None:
  """The string ``key="..."`` of an HLO instruction's metadata, unescaped; None if absent."""
  m = re.search(key + r'="((?:[^"\\]|\\.)*)"', text)
  return None if m is None else _unescape(m.group(1))


def _inserted(instr: _Instr) -> bool:
  """An instruction the compiler added (no JAX metadata: a CPU bf16 upcast, a layout
  copy): its buffer holds its operand's value in another form."""
  return not instr.op_name and instr.frame is None and not instr.source_file


def _with_outer(inner: _Instr, outer: _Instr) -> _Instr:
  """A fused root's identity with the fusion's metadata where the root has none."""
  if inner.frame is None and not inner.source_file:
    return dataclasses.replace(inner, frame=outer.frame, source_file=outer.source_file,
                               source_line=outer.source_line, op_name=outer.op_name)
  return inner


def _short(path: str) -> str:
  """A source path relative to the project or site-packages, for tables."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
  if path.startswith(root):
    return path[len(root):]
  return path.split("/site-packages/", 1)[-1]
