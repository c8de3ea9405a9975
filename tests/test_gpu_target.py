"""Compiling for a GPU that is not attached (lowmem_jax.gpu_target): what the dispatch
decides for under a target (no plugin needed: the target is set by hand), and, where jax's
CUDA plugin is installed, real deviceless compiles in fresh processes: XLA:GPU's executable
(cuBLAS calls, cuDNN attention) and its compiled memory, through train.bench and
benchmarks.llama_fit."""

import json
import os
import subprocess
import sys
from importlib import util
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from lowmem_jax import attention, gpu_target
from lowmem_jax.policy import MemoryPolicy
from train import planner
from jax_versions import skip_unless_pallas_lowers_for_cuda_here

ROOT = Path(__file__).resolve().parents[1]
H100 = gpu_target.TARGETS["h100"]
PLUGIN = (util.find_spec("jax_plugins") is not None
          and any(util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13)))
needs_plugin = pytest.mark.skipif(
    not PLUGIN,
    reason="jax's CUDA plugin is not installed (pip install jax-cuda12-plugin==<jax version>)")


@pytest.fixture
def as_h100(monkeypatch):
  """The H100 target active, without compiling anything (no plugin needed)."""
  monkeypatch.setattr(gpu_target, "_active", H100)
  return H100


def test_unknown_target_names_the_known_ones():
  with pytest.raises(ValueError, match=r"'a100'.*known: h100"):
    gpu_target.resolve("a100")


def test_config_text_states_the_device():
  text = H100.config_text()
  assert "cuda_compute_capability { major: 9 minor: 0 }" in text
  assert f"device_memory_size: {H100.memory_bytes}" in text
  assert "dnn_version_info { major: 9 minor: 8 patch: 0 }" in text
  assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in text


def test_no_target_changes_nothing():
  tree = {"x": jnp.ones((2, 3)), "n": 3}
  with gpu_target.compiling_for(None) as target:
    assert target is None and gpu_target.active() is None
    assert gpu_target.place(tree) is tree
    assert gpu_target.platform() is None
    assert gpu_target.bytes_limit() is None


def test_dispatch_decides_for_the_target(as_h100):
  assert gpu_target.backend() == "gpu"
  assert attention._platform() == ("gpu", H100.cudnn_version, H100.compute_capability)
  # ViT-B's 197 tokens: cuDNN refuses an odd length, the dispatch pads or goes flash;
  # on the CPU the same call is always flash (no cuDNN)
  q = (64, 197, 12, 64)
  on_target = attention.choose_implementation(q, q, jnp.bfloat16, backend="gpu",
                                              cudnn_version=H100.cudnn_version,
                                              compute_capability=H100.compute_capability)
  assert on_target.implementation in ("cudnn_padded", "flash"), on_target
  # the Pallas kernels compile for GPU only: under the target they are allowed
  assert MemoryPolicy.parse("lowmembp+kernels=pallas").kernel_implementation() == "pallas"


def test_jax_cudnn_attention_checks_its_calls_against_the_target():
  """jax's cuDNN attention asks the installed cuDNN for its version (none with the plugin
  alone: "cuDNN not found", every cuDNN compile failed) and the local backend for Hopper;
  under the target both answer the target's, and nothing is left patched after."""
  from jax._src.cudnn import fused_attention_stablehlo as fmha
  before = (fmha.check_cudnn_version, fmha.check_compute_capability)
  with gpu_target._cudnn_answers_for(H100):
    assert fmha.check_cudnn_version() == H100.cudnn_version
    assert fmha.check_compute_capability("9.0") and fmha.check_compute_capability("8.0")
    assert not fmha.check_compute_capability("10.0")
    assert fmha.is_cuda_compute_capability_equal("9.0")
  assert (fmha.check_cudnn_version, fmha.check_compute_capability) == before
  if jax.default_backend() != "gpu":
    assert not fmha.check_compute_capability("9.0")


def test_without_target_the_dispatch_is_local():
  local = jax.default_backend()
  assert gpu_target.backend() == local and attention._platform()[0] == local
  if local != "gpu":
    with pytest.raises(ValueError, match="compile for GPU only"):
      MemoryPolicy.parse("lowmembp+kernels=pallas").kernel_implementation()


def test_planner_budget_and_family_follow_the_target(as_h100, monkeypatch):
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  assert gpu_target.bytes_limit() == H100.memory_bytes // 2
  assert planner.resolve_budget("auto") == int(H100.memory_bytes * 0.5 * (1 - planner.AUTO_MARGIN))
  assert planner.resolve_budget("1GiB") == 2 ** 30
  assert planner.device_family({"cpu": {}, "h100": {}}) == "h100"


def test_missing_plugin_is_a_clear_error(monkeypatch):
  if PLUGIN:
    pytest.skip("the plugin is installed here")
  gpu_target.device.cache_clear()
  with pytest.raises(gpu_target.TargetUnavailable, match="pip install .jax-cuda12-plugin=="):
    with gpu_target.compiling_for("h100"):
      pass
  assert gpu_target.active() is None


def _run(args, tmp_path):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop("JAX_PLATFORMS", None)  # the module itself keeps jax on the CPU
  return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, text=True,
                        capture_output=True, timeout=600)


def _script_json(source: str, tmp_path):
  """``source`` run as a script in a fresh process; its last line of output, as JSON."""
  script = tmp_path / "probe.py"
  script.write_text(source)
  proc = _run([str(script)], tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_plugin
def test_deviceless_compile_is_xla_gpu(tmp_path):
  """A step compiled under the target is XLA:GPU's (cuBLAS GEMMs, cuDNN flash attention),
  on its simulated device; outside it, the local backend's."""
  got = _script_json(
      "import json, jax, jax.numpy as jnp\n"
      "from lowmem_jax import gpu_target\n"
      "def f(w, q):\n"
      "  o = jax.nn.dot_product_attention(q, q, q, implementation='cudnn')\n"
      "  return jnp.sum((o.reshape(-1, 64) @ w).astype(jnp.float32) ** 2)\n"
      "args = (jax.ShapeDtypeStruct((64, 64), jnp.bfloat16),\n"
      "        jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16))\n"
      "g = jax.jit(jax.grad(f))\n"
      "with gpu_target.compiling_for('h100'):\n"
      "  c = g.lower(*gpu_target.place(args)).compile()\n"
      "text = c.as_text()\n"
      "print(json.dumps({'cublas': '__cublas' in text, 'cudnn': '__cudnn$fmha' in text,\n"
      "  'temp': c.memory_analysis().temp_size_in_bytes,\n"
      "  'device': str(c.input_shardings[0][0].device_set.pop().device_kind),\n"
      "  'local': jax.default_backend()}))\n", tmp_path)
  assert got["cublas"] and got["cudnn"], got
  assert got["device"] == H100.device_kind and got["local"] == "cpu"
  assert got["temp"] > 0


@needs_plugin
def test_unrolled_layers_keep_no_cast_of_the_whole_weight_stack(tmp_path):
  """Unrolled layers casting their slices of a stacked fp32 weight to bf16: XLA:GPU
  (0.10.2 and 0.11.2) turns the casts into one of the whole stack, every layer's bf16
  copy then live at once; compiled with the unrolled policy's options it does not."""
  got = _script_json(
      "import json, jax, jax.numpy as jnp\n"
      "from lowmem_jax import gpu_target\n"
      "from lowmem_jax.layers import Unrolled\n"
      "from lowmem_jax.policy import MemoryPolicy\n"
      "def loss(w, x):\n"
      "  step = lambda c, wi: (jnp.tanh(c @ wi.astype(jnp.bfloat16)), None)\n"
      "  return Unrolled()(step, x, w)[0].astype(jnp.float32).sum()\n"
      "args = (jax.ShapeDtypeStruct((4, 512, 512), jnp.float32),\n"
      "        jax.ShapeDtypeStruct((64, 512), jnp.bfloat16))\n"
      "out = {}\n"
      "for name, opts in (('without', None),\n"
      "    ('with', MemoryPolicy.parse('layers=unrolled').compiler_options())):\n"
      "  g = jax.jit(jax.grad(loss, argnums=1), compiler_options=opts)\n"
      "  with gpu_target.compiling_for('h100'):\n"
      "    out[name] = 'bf16[4,512,512]' in g.lower(*gpu_target.place(args)).compile().as_text()\n"
      "print(json.dumps(out))\n", tmp_path)
  assert got == {"without": True, "with": False}, got


@needs_plugin
@pytest.mark.slow
def test_bench_and_llama_fit_compile_for_the_target(tmp_path):
  out = tmp_path / "bench.json"
  proc = _run(["-m", "train.bench", "--compile-only", "--target", "h100", "--synthetic", "8",
               "--set", "model=vit-tiny", "--set", "batch_size=4",
               "--policies", "baseline,lowmembp", "--json", str(out)], tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  bench = json.loads(out.read_text())
  assert bench["device_kind"] == H100.device_kind and bench["compile_target"] == "h100"
  assert [r["policy"] for r in bench["rows"]] == ["baseline", "lowmembp"]
  assert all(r["compiled"]["temp"] > 0 for r in bench["rows"])

  out = tmp_path / "fit.json"
  proc = _run(["-m", "benchmarks.llama_fit", "--smoke", "--target", "h100",
               "--memory-budget", "64MiB", "--json", str(out)], tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  fit = json.loads(out.read_text())
  assert fit["compile_target"] == "h100"
  (row,) = fit["rows"]  # no peer row: nothing runs under a target
  assert row["kind"] == "ours" and row["compile_target"] == "h100", row
  assert row["max_batch_aot"] >= 1 and row["predicted_peak_aot"] <= 64 * 2 ** 20
  assert "max_batch_run" not in row

  out = tmp_path / "depth.json"
  proc = _run(["-m", "benchmarks.reversible_depth", "--smoke", "--compile-only", "--target",
               "h100", "--policies", "baseline,pareprop,reversible=pareprop-stream", "--json",
               str(out)], tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  depth = json.loads(out.read_text())
  assert depth["compile_target"] == "h100" and depth["device_kind"] == H100.device_kind
  assert depth["compile_growth"]["pareprop"]["temp_growth_per_layer"] == 0
  # the rebuild as one stream-annotated call compiles (annotated op by op: "a cycle")
  assert min(depth["compile_growth"]["reversible=pareprop-stream"]["temp"]) > 0
  assert depth["compile_growth"]["baseline"]["temp_growth_per_layer"] > 0


@needs_plugin
def test_kernel_bench_programs_compile_for_the_target(tmp_path):
  """Every Pallas kernel and its jnp reference, looped as the kernel bench times them,
  compiles for the target: the kernel to a Triton call, each loop with its work intact."""
  skip_unless_pallas_lowers_for_cuda_here()
  rows = _script_json(
      "import json, jax.numpy as jnp\n"
      "from lowmem_jax import gpu_target\n"
      "from lowmem_jax.kernel_bench import kernel_cases, looped, loop_intact\n"
      "rows = []\n"
      "with gpu_target.compiling_for('h100'):\n"
      "  for dtype in (jnp.bfloat16, jnp.float32):\n"
      "    for name, pallas_fn, xla_fn, args, _ in kernel_cases(2**16, 768, dtype, False):\n"
      "      for which, fn in (('pallas', pallas_fn), ('xla', xla_fn)):\n"
      "        text = looped(fn, 64).lower(*gpu_target.place(args)).compile().as_text()\n"
      "        rows.append([name, which, '__gpu$xla.gpu.triton' in text,\n"
      "                     loop_intact(text, 64)])\n"
      "print(json.dumps(rows))\n", tmp_path)
  assert len(rows) == 24
  assert all(intact for *_, intact in rows), rows
  assert all(triton for _, which, triton, _ in rows if which == "pallas"), rows


@needs_plugin
def test_cudnn_refusal_agrees_with_the_targets_compiler(tmp_path):
  """``attention.cudnn_refusal`` refuses exactly the shapes XLA:GPU's compile of jax's
  cuDNN attention (forward + backward) refuses for the target: odd lengths, not even ones."""
  rows = _script_json(
      "import json, jax, jax.numpy as jnp\n"
      "from lowmem_jax import attention, gpu_target\n"
      "rows = []\n"
      "with gpu_target.compiling_for('h100'):\n"
      "  backend, version, capability = gpu_target.platform()\n"
      "  for head_dim, causal in ((64, False), (128, True)):\n"
      "    for n in (17, 18, 197, 198, 1024):\n"
      "      s = jax.ShapeDtypeStruct((2, n, 4, head_dim), jnp.bfloat16)\n"
      "      ours = attention.cudnn_refusal(s.shape, s.shape, s.dtype, backend=backend,\n"
      "          cudnn_version=version, compute_capability=capability)\n"
      "      f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,\n"
      "          implementation='cudnn').astype(jnp.float32).sum()\n"
      "      try:\n"
      "        jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(\n"
      "            *gpu_target.place((s, s, s))).compile()\n"
      "        compiled = True\n"
      "      except Exception:\n"
      "        compiled = False\n"
      "      rows.append([head_dim, n, ours is None, compiled])\n"
      "print(json.dumps(rows))\n", tmp_path)
  assert all(ours == compiled for _, _, ours, compiled in rows), rows
  assert {n for _, n, _, compiled in rows if not compiled} == {17, 197}, rows
