"""peak_buffers: the buffers live at the compiled peak, read off XLA's dumps."""

import jax
import jax.numpy as jnp
import pytest

from lowmem_jax import buffer_assignment
from lowmem_jax.memory import peak_buffers


def _scores_step(x):
  """A loss whose backward keeps a [256, 256] fp32 array made on one known line."""
  def loss(x):
    scores = jnp.exp(x @ x.T / 64.0)  # the line that makes the kept array
    return jnp.sum(jnp.log1p(scores))
  return jax.grad(loss)(x)


def _line_of(text):
  import inspect
  lines, start = inspect.getsourcelines(_scores_step)
  return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.precision("default")
def test_the_peak_lists_the_kept_array_with_its_source_line():
  x = jax.ShapeDtypeStruct((256, 64), jnp.float32)
  peak = peak_buffers(_scores_step, x, top=5)
  square = peak.find(shape=(256, 256), dtype="float32")
  assert square, peak.table()
  assert peak.find(shape=(256, 256), dtype=jnp.float32) == square  # a dtype, not its name
  line = f"tests/test_buffer_assignment.py:{_line_of('the line that makes')}"
  assert any(b.source.startswith(line) for b in square), [b.source for b in square]
  assert peak.find(kind="argument") and peak.find(kind="argument")[0].shape == (256, 64)
  assert peak.peak_bytes == sum(b.nbytes for b in peak.buffers)
  assert peak.buffers == tuple(sorted(peak.buffers, key=lambda b: (-b.nbytes, b.name)))
  by_line = dict((s, n) for s, n, _ in peak.by_source())
  assert by_line[next(b.source for b in square)] >= 256 * 256 * 4
  text = peak.table()
  assert "float32[256, 256]" in text and "by source line" in text
  # a second compile of the same program (the persistent cache on) still dumps
  assert peak_buffers(_scores_step, x).peak_bytes == peak.peak_bytes


@pytest.mark.precision("default")
def test_scan_residuals_are_traced_to_the_value_they_stack():
  def step(ws, x):
    def loss(ws):
      def body(h, w):
        return jnp.tanh(h @ w), None  # the stacked residual: tanh's output
      return jnp.sum(jax.lax.scan(body, x, ws)[0])
    return jax.grad(loss)(ws)
  peak = peak_buffers(step, jax.ShapeDtypeStruct((6, 32, 32), jnp.float32),
                      jax.ShapeDtypeStruct((512, 32), jnp.float32))
  stacked = peak.find(shape=(6, 512, 32), dtype="float32")
  # the stack names the op in the scan's body whose value it stacks, not the scan nor its
  # dynamic-update-slice: tanh's output (XLA:CPU 0.10), or tanh's derivative, a multiply,
  # where XLA:CPU 0.11 computes that in the forward and stacks it instead
  assert any(b.instruction in ("tanh", "multiply") and b.source.endswith(".body)")
             for b in stacked), peak.table()


@jax.custom_vjp
def _tanh_int8(x):
  return jnp.tanh(x)


def _tanh_int8_fwd(x):
  scale = jnp.max(jnp.abs(x)) / 127
  return jnp.tanh(x), (jnp.round(x / scale).astype(jnp.int8), scale)


def _tanh_int8_bwd(res, g):
  code, scale = res
  return (g * (1 - jnp.tanh(code.astype(jnp.float32) * scale) ** 2),)


_tanh_int8.defvjp(_tanh_int8_fwd, _tanh_int8_bwd)


@pytest.mark.precision("default")
def test_a_scan_s_int8_codes_are_at_the_peak_within_the_allocations():
  """A Mesa-like scan (each layer keeps an int8 code of its input): the stacked codes
  are live at the peak, and the peak's distinct bytes fit in what the executable
  allocates (temp + arguments + outputs - aliased), which counting a loop buffer and its
  in-place update twice would not guarantee."""
  layers, n, d = 8, 1024, 256

  def step(ws, x):
    def loss(ws):
      return jnp.sum(jax.lax.scan(lambda h, w: (_tanh_int8(h @ w), None), x, ws)[0])
    return jax.grad(loss)(ws)

  args = (jax.ShapeDtypeStruct((layers, d, d), jnp.float32),
          jax.ShapeDtypeStruct((n, d), jnp.float32))
  peak = peak_buffers(step, *args)
  assert peak.find(shape=(layers, n, d), dtype="int8"), peak.table()
  m = jax.jit(step).lower(*args).compile().memory_analysis()
  allocated = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
               - m.alias_size_in_bytes)
  # live at the backward's start: the codes, the stacked layer inputs, ws, x, the gradient
  kept = layers * n * d * (1 + 4) + 2 * layers * d * d * 4 + n * d * 4
  assert kept <= peak.peak_bytes <= allocated, (kept, peak.peak_bytes, allocated)


def _values(**slots):
  """name{} -> _Value from (kind, allocation, offset, size) tuples."""
  return {f"{n}{{}}": buffer_assignment._Value(kind=k, type_text=f"u8[{size}]", allocation=a,
                                              offset=o, size=size)
          for n, (k, a, o, size) in slots.items()}


def _ranges(**spans):
  return "\n".join(["HloLiveRange (max 9):", "  BufferLiveRange:"]
                    + [f"    {n}{{}}:{s}-{e}" for n, (s, e) in spans.items()])


def test_the_peak_is_the_moment_with_the_most_bytes_live():
  # a (16) and c (2) at 0-1, b (32) and c at 1-3: the peak is at 1, all three live
  values = _values(a=("temp", 0, 0, 16), b=("temp", 0, 16, 32), c=("argument", 1, 0, 2))
  text = _ranges(a=(0, 1), b=(1, 3), c=(0, 4))
  assert sorted(buffer_assignment._peak_live(text, values)) == [("a{}", 16), ("b{}", 32),
                                                                ("c{}", 2)]
  # a ends before b starts: the peak is b's moment, a is not counted
  text = _ranges(a=(0, 0), b=(1, 3), c=(0, 4))
  assert sorted(buffer_assignment._peak_live(text, values)) == [("b{}", 32), ("c{}", 2)]


def test_values_sharing_bytes_are_counted_once():
  # "loop" and "update" are one buffer (same allocation and offset: an in-place update);
  # "other" (24 bytes) elsewhere is live only while "update" alone holds the slot
  values = _values(loop=("temp", 0, 0, 32), update=("temp", 0, 0, 32),
                   small=("temp", 0, 32, 4), other=("temp", 0, 64, 24))
  text = _ranges(loop=(0, 2), update=(1, 4), small=(0, 1), other=(3, 4))
  # counting aliases twice would put the peak at 1 (32+32+4 = 68); the distinct bytes are
  # 36 there and 56 at 3-4
  assert sorted(buffer_assignment._peak_live(text, values)) == [("other{}", 24),
                                                                ("update{}", 32)]
  # at a moment where both aliases are live, the slot is listed once (the original)
  text = _ranges(loop=(0, 2), update=(1, 4), small=(0, 1))
  assert sorted(buffer_assignment._peak_live(text, values)) == [("loop{}", 32),
                                                                ("small{}", 4)]


def test_host_memory_is_not_device_memory():
  """Offload's pinned host buffers (an allocation of another memory space, ``color 5``)
  are left out of the device peak."""
  text = ("allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:\n"
          " value: <1 p @0> (size=64,offset=0): f32[16]{0}\n"
          "allocation 1: size 4096, color 5, preallocated-temp:\n"
          " value: <2 off @5> (size=4096,offset=0): bf16[2048]{0:S(5)}\n"
          "allocation 2: size 128, preallocated-temp:\n"
          " value: <3 t @0> (size=128,offset=0): f32[32]{0}\n")
  values = buffer_assignment._buffer_values(text)
  assert {k: v.kind for k, v in values.items()} == {"p{}": "argument", "off{}": "host",
                                                    "t{}": "temp"}
  ranges = _ranges(p=(0, 4), off=(0, 4), t=(1, 2))
  assert sorted(buffer_assignment._peak_live(ranges, values)) == [("p{}", 64), ("t{}", 128)]


def test_allocation_kinds_read_off_cpu_and_gpu_headers():
  """XLA:GPU (jax 0.11) starts each allocation's attributes with ``page N``; CPU does not.
  The kind comes from the attributes in any order (a donated argument is also the output;
  a tuple shape's commas are not attributes)."""
  kind = buffer_assignment._allocation_kind
  assert kind(", parameter 0, shape |f32[16]| at ShapeIndex {}") == "argument"
  assert kind(", page 0, parameter 1, shape |f32[512,32]| at ShapeIndex {}") == "argument"
  assert kind(", page 0, parameter 0, shape |(f32[2], s32[])| at ShapeIndex {1}") == "argument"
  assert kind(", parameter 0, shape |f32[8]| at ShapeIndex {}, output shape is |f32[8]|, "
              "maybe-live-out") == "argument"
  assert kind(", page 0, output shape is |f32[6,32,32]|, maybe-live-out") == "output"
  assert kind(", output shape is |(f32[2], f32[3])|, maybe-live-out") == "output"
  assert kind(", maybe-live-out") == "output"  # a tuple output's element (XLA:CPU)
  assert kind(", page 0, constant") == "constant"
  assert kind(", page 0, preallocated-temp") == "temp"
  assert kind(", color 5, preallocated-temp") == "host"
  assert kind(", color 0, parameter 0, shape |f32[8]| at ShapeIndex {}") == "argument"


# reduced from XLA:GPU's dump (jax 0.11.2, H100) of the scan test above: "page 0" in every
# allocation's header, and a dynamic-update-slice fusion run as an async-start/async-done
# pair whose computation wraps the fusion (so the stacked value is two calls deep)
_GPU_HLO = """HloModule jit_step, is_scheduled=true

FileNames
1 "tests/test_buffer_assignment.py"

FunctionNames
1 "step.<locals>.loss.<locals>.body"
2 "step.<locals>.loss"

FileLocations
1 {file_name_id=1 function_name_id=1 line=50 end_line=50 column=15 end_column=30}
2 {file_name_id=1 function_name_id=2 line=51 end_line=51 column=21 end_column=46}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}

%fused_dynamic_update_slice (param_0.1: f32[6,8], param_1.1: s32[], param_2.1: f32[8]) -> f32[6,8] {
  %param_0.1 = f32[6,8]{1,0} parameter(0)
  %param_2.1 = f32[8]{0} parameter(2)
  %bitcast.1 = f32[1,8]{1,0} bitcast(%param_2.1), \
metadata={op_name="jit(step)/tanh" stack_frame_id=1}
  %param_1.1 = s32[] parameter(1)
  %constant_1 = s32[] constant(0)
  ROOT %dynamic_update_slice.1 = f32[6,8]{1,0} dynamic-update-slice(%param_0.1, %bitcast.1, \
%param_1.1, %constant_1), metadata={op_name="jit(step)/dynamic_update_slice" stack_frame_id=2}
}

%async_computation (param_0.2: f32[6,8], param_1.2: s32[], param_2.2: f32[8]) -> f32[6,8] {
  %param_0.2 = f32[6,8]{1,0} parameter(0)
  %param_1.2 = s32[] parameter(1)
  %param_2.2 = f32[8]{0} parameter(2)
  ROOT %loop_dynamic_update_slice_fusion = f32[6,8]{1,0} fusion(%param_0.2, %param_1.2, \
%param_2.2), kind=kLoop, calls=%fused_dynamic_update_slice, \
metadata={op_name="jit(step)/dynamic_update_slice" stack_frame_id=2}
}

%wrapped_tanh_computation (param_0.3: f32[8]) -> f32[8] {
  %param_0.3 = f32[8]{0} parameter(0)
  ROOT %tanh.1 = f32[8]{0} tanh(%param_0.3), metadata={op_name="jit(step)/tanh" stack_frame_id=1}
}

ENTRY %main.1 (x.1: f32[8], i.1: s32[], acc.1: f32[6,8]) -> f32[6,8] {
  %x.1 = f32[8]{0} parameter(0), metadata={op_name="x"}
  %i.1 = s32[] parameter(1), metadata={op_name="i"}
  %acc.1 = f32[6,8]{1,0} parameter(2), metadata={op_name="acc"}
  %constant_2 = s32[] constant(6)
  %wrapped_tanh = f32[8]{0} fusion(%x.1), kind=kLoop, calls=%wrapped_tanh_computation, \
metadata={op_name="jit(step)/tanh" stack_frame_id=1}
  %copy.1 = f32[6,8]{1,0} copy(%acc.1)
  %fusion-start = ((f32[6,8]{1,0}, s32[], f32[8]{0}), f32[6,8]{1,0}, u32[]) async-start(%copy.1, \
%i.1, %wrapped_tanh), calls=%async_computation, \
metadata={op_name="jit(step)/dynamic_update_slice" stack_frame_id=2}
  ROOT %fusion-done = f32[6,8]{1,0} async-done(%fusion-start), \
metadata={op_name="jit(step)/dynamic_update_slice" stack_frame_id=2}
}
"""

_GPU_BUFFERS = """BufferAssignment:
allocation 0: size 192, page 0, output shape is |f32[6,8]|, maybe-live-out:
 value: <6 loop_dynamic_update_slice_fusion @0> (size=192,offset=0): f32[6,8]{1,0}
allocation 1: size 32, page 0, parameter 0, shape |f32[8]| at ShapeIndex {}:
 value: <1 x.1 @0> (size=32,offset=0): f32[8]{0}
allocation 2: size 4, page 0, parameter 1, shape |s32[]| at ShapeIndex {}:
 value: <2 i.1 @0> (size=4,offset=0): s32[]
allocation 3: size 192, page 0, parameter 2, shape |f32[6,8]| at ShapeIndex {}:
 value: <3 acc.1 @0> (size=192,offset=0): f32[6,8]{1,0}
allocation 4: size 4, page 0, constant:
 value: <7 constant_2 @0> (size=4,offset=0): s32[]
allocation 5: size 256, page 0, preallocated-temp:
 value: <4 wrapped_tanh @0> (size=32,offset=0): f32[8]{0}
 value: <8 fusion-start{} @0> (size=24,offset=32): ((f32[6,8]{1,0}, s32[], f32[8]{0}), \
f32[6,8]{1,0}, u32[])
 value: <9 fusion-start{2} @0> (size=4,offset=56): u32[]
 value: <5 copy.1 @0> (size=192,offset=64): f32[6,8]{1,0}
"""

_GPU_LIVE_RANGES = """HloLiveRange (max 10):
  BufferLiveRange:
    x.1{}:0-10
    i.1{}:0-10
    acc.1{}:0-10
    constant_2{}:0-10
    wrapped_tanh{}:3-9
    copy.1{}:4-9
    fusion-start{}:5-10
    fusion-start{2}:5-10
    loop_dynamic_update_slice_fusion{}:9-10
"""


def test_a_gpu_dump_reads_its_arguments_and_async_fusions(tmp_path):
  """XLA:GPU's format, read on any backend: the entry parameters are arguments, and the
  stack an async dynamic-update-slice fusion writes names the value it stacks (tanh)."""
  prefix = tmp_path / "module_0013.jit_step.sm_9.0a_gpu_after_optimizations"
  for suffix, text in (("", _GPU_HLO), ("-buffer-assignment", _GPU_BUFFERS),
                       ("-live-range", _GPU_LIVE_RANGES)):
    (tmp_path / f"{prefix.name}{suffix}.txt").write_text(text)
  peak = buffer_assignment.read_dump(str(tmp_path))
  got = {b.name: (b.kind, b.instruction, b.source) for b in peak.buffers}
  body, loss = ("tests/test_buffer_assignment.py:50 (step.<locals>.loss.<locals>.body)",
                "tests/test_buffer_assignment.py:51 (step.<locals>.loss)")
  assert got == {
      "x.1{}": ("argument", "parameter", "x"),
      "i.1{}": ("argument", "parameter", "i"),
      "acc.1{}": ("argument", "parameter", "acc"),
      "constant_2{}": ("constant", "constant", "constant_2"),
      "wrapped_tanh{}": ("temp", "tanh", body),
      "copy.1{}": ("temp", "parameter", "acc"),  # an inserted copy holds the argument
      "fusion-start{}": ("temp", "async-start", loss),
      "fusion-start{2}": ("temp", "async-start", loss),
      "loop_dynamic_update_slice_fusion{}": ("output", "tanh", body)}, got
  assert peak.peak_bytes == 32 + 4 + 192 + 4 + 32 + 192 + 24 + 4 + 192
  assert peak.bytes_of("argument") == 228 and peak.bytes_of("output") == 192
  # the async-done's value is the same stack, found through the async-start's computation
  hlo = buffer_assignment.HloText(_GPU_HLO)
  done = hlo.origin("fusion-done")
  assert (done.opcode, hlo.source(done)) == ("tanh", body)
  assert hlo.instrs["fusion-done"].root_opcode == "dynamic-update-slice"
  assert hlo.instrs["fusion-start"].root_opcode == "async-start"


def test_argument_sources_read_as_python():
  """HLO escapes quotes in metadata (``p[\\'w\\']``); the tables show ``p['w']``."""
  w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  peak = peak_buffers(lambda p: jnp.tanh(p["w"]) @ p["w"], {"w": w})
  assert [b.source for b in peak.find(kind="argument")] == ["p['w']"], peak.table()


def test_a_folder_without_a_dump_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no \\*after_optimizations-buffer-assignment"):
    buffer_assignment.read_dump(str(tmp_path))


def test_a_tuple_output_s_elements_are_output_as_memory_analysis_counts_them():
  """XLA:CPU writes a tuple output's element allocations as "maybe-live-out" without
  "output shape is"; they were read as temp (a train step's new parameters among them)."""
  from lowmem_jax.memory import compiled_memory
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  pair = lambda a, b: (a @ b, a - b)
  totals = compiled_memory(jax.jit(pair).lower(x, x).compile())
  peak = peak_buffers(pair, x, x)
  assert peak.bytes_of("temp") == totals.temp == 0, peak.table()
  assert peak.bytes_of("output") == totals.output, peak.table()


def test_a_kept_dump_is_this_compile_s_not_an_older_one_in_the_folder(tmp_path):
  """``keep_dump`` named a folder that held another process's dump (module ids restart in
  each process): the module whose name sorted last was read, not the one compiled."""
  big = peak_buffers(lambda x: jnp.tanh(x @ x.T), jax.ShapeDtypeStruct((256, 64), jnp.float32),
                     keep_dump=str(tmp_path))
  for path in tmp_path.iterdir():  # as if an earlier process had compiled module 9999
    path.rename(tmp_path / path.name.replace("module_", "module_9", 1))
  small = peak_buffers(lambda x: x * 2, jax.ShapeDtypeStruct((8,), jnp.float32),
                       keep_dump=str(tmp_path))
  assert small.peak_bytes < 1024 < big.peak_bytes, small.table()
  again = buffer_assignment.read_dump(str(tmp_path))  # the folder's newest module
  assert again.peak_bytes == small.peak_bytes


def test_threads_leave_the_persistent_cache_as_they_found_it():
  """Two threads inside :func:`no_persistent_cache`, the first in leaving first: the
  second had saved the first's "off" and put it back last, leaving the cache off."""
  import threading
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", True)
  try:
    first_in, both_in, first_out = threading.Event(), threading.Barrier(3), threading.Event()

    def first():
      with buffer_assignment.no_persistent_cache():
        first_in.set()
        both_in.wait()
      first_out.set()

    def second():
      with buffer_assignment.no_persistent_cache():
        both_in.wait()
        first_out.wait()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    threads[0].start()
    first_in.wait()  # the first is inside before the second enters
    threads[1].start()
    both_in.wait()
    assert not jax.config.jax_enable_compilation_cache
    for t in threads:
      t.join(timeout=30)
    assert jax.config.jax_enable_compilation_cache
  finally:
    jax.config.update("jax_enable_compilation_cache", before)
