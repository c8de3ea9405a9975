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
  # the stack of tanh outputs names tanh in the scan's body, not the scan
  assert any(b.instruction == "tanh" and b.source.endswith(".body)") for b in stacked), \
      peak.table()


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


def test_argument_sources_read_as_python():
  """HLO escapes quotes in metadata (``p[\\'w\\']``); the tables show ``p['w']``."""
  w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  peak = peak_buffers(lambda p: jnp.tanh(p["w"]) @ p["w"], {"w": w})
  assert [b.source for b in peak.find(kind="argument")] == ["p['w']"], peak.table()


def test_a_folder_without_a_dump_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no \\*after_optimizations-buffer-assignment"):
    buffer_assignment.read_dump(str(tmp_path))
