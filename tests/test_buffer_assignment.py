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


def test_without_xla_s_peak_list_the_peak_is_swept_from_live_ranges():
  values = {"a{}": ("temp", "f32[4]"), "b{}": ("temp", "f32[8]"), "c{}": ("argument", "s8[2]")}
  text = "\n".join(["HloLiveRange (max 4):", "  BufferLiveRange:",
                    "    a{}:0-1", "    b{}:1-3", "    c{}:0-4"])
  assert sorted(buffer_assignment._peak_live(text, values)) == [("a{}", 16), ("b{}", 32),
                                                                ("c{}", 2)]


def test_a_folder_without_a_dump_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no \\*after_optimizations-buffer-assignment"):
    buffer_assignment.read_dump(str(tmp_path))
