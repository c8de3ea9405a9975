"""Shared test settings.

Matmul precision: XLA:GPU runs fp32 matmuls as TF32 unless told otherwise, so every test
runs under ``jax.default_matmul_precision("highest")`` (fp32 means fp32 on every backend)
unless it says otherwise with ``@pytest.mark.precision("default")``: memory and speed
checks, which must see the executable users get. Subprocess tests pass the same choice
through ``JAX_DEFAULT_MATMUL_PRECISION`` (set here for the whole session).

Compilation cache: most of the suite's time is XLA compiling, and many tests compile the
same program (a trainer's step, again after a resume, again in a CLI subprocess). One
persistent cache per pytest session, shared by the xdist workers and the subprocesses
they start, compiles each program once. It is a fresh folder per session, removed at the
end, so every run compiles what it runs as CI does (set ``JAX_COMPILATION_CACHE_DIR``
yourself to keep one across runs). Measured on 2 cores, test_train + test_vit + test_llama
in one run each way: 197 s with it, 256 s with ``JAX_ENABLE_COMPILATION_CACHE=false``.

Compile time on the CPU: the suite is mostly XLA:CPU compiling tiny programs, and most of
a compile is code generation for machine code that then runs for milliseconds. Where no
GPU is attached (a GPU plugin and its driver's device node) the session adds two
code-generation flags to ``XLA_FLAGS`` (:func:`with_test_xla_flags` keeps them in
subprocesses that set their own):
``--xla_backend_optimization_level=0`` (LLVM does not optimize; two test files 43.5 s ->
29.2 s on 2 cores) and ``--xla_cpu_use_fusion_emitters=false`` (fusions are emitted
straight to LLVM IR, not through the MLIR fusion emitters; test_vit + test_llama 62 s ->
44 s; jaxlib < 0.11 only: 0.11's XLA has no such flag). Neither changes what XLA plans:
compiled temp of tiny ViT, LLaMA and BERT gradient steps is the same with and without
them to within 384 bytes (jaxlib 0.10), so compiled memory, residuals and HLO checks see
the program users get; values differ from the default code only by rounding. On a GPU
machine nothing is added (the tests there check the executables users get).

Tiny models: the model and training setups shared by test files (``from conftest import
TINY_TRAIN``), each a second or two to compile on a CPU.
"""

import gc
import os
import re
import shutil
import tempfile

TEST_PRECISION = "highest"
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", TEST_PRECISION)
# pytest-xdist workers share one GPU: each takes memory as it needs it, not 75% up front
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# imported first by the controller, whose environment the workers inherit
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lowmem-jax-xla-cache-")
  os.environ["LOWMEM_JAX_TEST_CACHE_OWNED"] = "1"
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _jaxlib_version() -> tuple[int, int]:
  """jaxlib's (major, minor), read without importing it (XLA_FLAGS must be set first)."""
  from importlib import metadata
  major, minor = re.findall(r"\d+", metadata.version("jaxlib"))[:2]
  return int(major), int(minor)


# the XLA of jaxlib 0.11 has no --xla_cpu_use_fusion_emitters, and an unknown flag in
# XLA_FLAGS aborts the process (every worker would die at its first compile)
CPU_TEST_XLA_FLAGS = "--xla_backend_optimization_level=0" + (
    " --xla_cpu_use_fusion_emitters=false" if _jaxlib_version() < (0, 11) else "")


def _gpu_attached() -> bool:
  """A GPU plugin is installed and its driver's device node exists (read before JAX starts:
  the flags must be set first). A plugin on a machine without a GPU runs the tests on the
  CPU, which then gets the CPU flags."""
  from importlib import metadata
  plugin = any((d.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax_cuda", "jax-rocm"))
               for d in metadata.distributions())
  nodes = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg", "/dev/kfd")  # CUDA, WSL2, ROCm
  return plugin and any(os.path.exists(node) for node in nodes)


def with_test_xla_flags(flags: str = "") -> str:
  """``flags`` plus the session's CPU compile flags (for a subprocess's ``XLA_FLAGS``)."""
  added = "" if _gpu_attached() else CPU_TEST_XLA_FLAGS
  return " ".join(f for f in (flags, added) if f)


if CPU_TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = with_test_xla_flags(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402  (after the environment: JAX reads it at import)
import pytest  # noqa: E402


# Overrides of a model preset's config (``vit.config("vit-digits", **TINY_MODEL)``, or
# ``--set model.<key>=<value>``): one block of width 32.
TINY_MODEL = {"num_layers": 1, "dim": 32, "mlp_dim": 64}
# The training tests' digits-vit run: TINY_MODEL in fp32, a log line every step, no eval and
# no baseline compile (``key=value`` overrides, as ``load_config`` and ``--set`` take them).
TINY_TRAIN = [*(f"model.{k}={v}" for k, v in TINY_MODEL.items()), "batch_size=32",
              "log_every=1", "eval_every=0", "compare_baseline=false", "dtype=float32"]


def set_args(overrides) -> list[str]:
  """``["k=v", ...]`` -> ``["--set", "k=v", ...]``: overrides as CLI arguments."""
  return [arg for kv in overrides for arg in ("--set", kv)]


def cli_error(main, argv, capsys) -> str:
  """The message of the one error line a command's ``main(argv)`` prints when argparse
  refuses ``argv`` (usage, then ``prog: error: message``; exit status 2)."""
  with pytest.raises(SystemExit) as exit_:
    main(argv)
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("usage: ") and err.count(": error: ") == 1, err
  last = err.rstrip("\n").splitlines()[-1]
  assert ": error: " in last, err
  return last.split(": error: ", 1)[1]


# What jax writes to stderr where a CUDA plugin is installed on a machine without a GPU
# driver (jax-cuda12-plugin 0.11.2 on a CPU host): two lines at import, and at the first
# backend use its plugin's failed initialization as a logged traceback. Not our lines:
# stderr checks drop them.
JAX_PLUGIN_STARTUP = re.compile(
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
    r"|^[IW]\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine")
JAX_PLUGIN_INIT_ERROR = re.compile(
    r"^(?:ERROR:jax\._src\.xla_bridge:)?Jax plugin configuration error: .*?"
    r"^RuntimeError: Unable to load CUDA\. Is it installed\?$", re.S | re.M)


def stderr_lines(text: str, *, progress: bool = False) -> list[str]:
  """A subprocess's stderr as its non-blank lines, the CUDA plugin's on a machine without
  a GPU (:data:`JAX_PLUGIN_STARTUP`, :data:`JAX_PLUGIN_INIT_ERROR`) dropped; with
  ``progress``, the progress bar's updates (``[#``; ``splitlines`` splits at its ``\\r``)
  too."""
  lines = JAX_PLUGIN_INIT_ERROR.sub("", text).splitlines()
  return [line for line in lines if line.strip() and not JAX_PLUGIN_STARTUP.search(line)
          and not (progress and line.startswith("[#"))]


def pytest_sessionfinish(session):
  """A worker frees its compiled programs before it reports that it has finished.

  pytest collects garbage at exit (after a worker's report), and each collection makes
  jax free the executables no one holds any more, seconds of work in a worker that
  compiled hundreds (measured at the end of the suite: 4.8 and 9.1 s, 2 workers).
  pytest-xdist stops a worker still busy 5 s after its report with a SIGINT, which pytest
  then printed as "Exception ignored in _xla_gc_callback: KeyboardInterrupt" after
  ``[100%]``. Done here, before the report, the controller waits for it."""
  if hasattr(session.config, "workerinput"):
    jax.clear_caches()
    gc.collect()


def pytest_unconfigure(config):
  """The controller removes the session's compilation cache (workers leave it alone)."""
  if not hasattr(config, "workerinput") and os.environ.get("LOWMEM_JAX_TEST_CACHE_OWNED"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def matmul_precision(request):
  """The test's matmul precision: its ``precision`` marker, else ``highest``."""
  marker = request.node.get_closest_marker("precision")
  name = marker.args[0] if marker else TEST_PRECISION
  if name == "default":
    name = None
  with jax.default_matmul_precision(name):
    yield name
