"""Compile for a GPU that is not attached: XLA:GPU's own executable and buffer assignment,
built on any machine (deviceless ahead-of-time compilation).

``with compiling_for("h100"):`` makes every compile of a train step inside it target one
simulated NVIDIA H100 80GB HBM3 (:data:`TARGETS`) instead of the local backend:

* :func:`place` puts a pytree of arrays / ShapeDtypeStructs on the target device as
  ShapeDtypeStructs (``Trainer.lower`` and ``peak_buffers`` call it, so ``memory_analysis()``
  and the buffer-assignment dump are XLA:GPU's; nothing runs, nothing is copied);
* :func:`platform` is what the dispatch decides for (``"gpu"``, with the target's cuDNN
  version and compute capability), so ``attention="auto"`` and ``kernels="auto"`` pick what
  they would pick on that GPU; jax's cuDNN attention checks its calls against the same
  two (not a cuDNN library, which the plugin does not bring).

What it gives: compiled memory (temp, arguments, outputs) and the live buffers at the peak,
as XLA:GPU plans them. What it cannot give: autotuned kernel choices (nothing is measured:
every matmul goes to cuBLAS, :data:`DEVICELESS_XLA_FLAGS`, where the GPU's autotuner may
pick a Triton fusion for some), the allocator's fragmentation, CUDA/cuDNN/cuBLAS handles
outside the executable, and any speed. The jaxlib here compiles, not the GPU machine's. A real GPU's
``peak_bytes_in_use`` remains the check (``python -m lowmem_jax.gpu_check``).

Needs jax's CUDA plugin (``pip install "jax-cuda12-plugin==$(python -c 'import jax;
print(jax.__version__)')"``: the compiler, no CUDA libraries or driver) and, on a machine
without a GPU, the CPU as jax's only platform: :func:`device` sets ``jax_platforms="cpu"``
when the backends are not yet initialised, and says so when they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
from collections.abc import Iterator

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Target:
  """One GPU model as the compiler sees it (XLA's ``GpuTargetConfig``)."""
  name: str
  device_kind: str
  compute_capability: tuple[int, int]
  cudnn_version: int          # 9.8.0 -> 90800 (assumed: the GPU image's is unrecorded)
  cuda_runtime: tuple[int, int, int]
  memory_bytes: int           # what the device reports as its memory
  core_count: int
  memory_bandwidth: int       # bytes/s
  l2_cache_bytes: int
  clock_rate_ghz: float
  shared_memory_per_block_optin: int
  shared_memory_per_core: int

  def config_text(self) -> str:
    """The target as XLA's ``GpuTargetConfigProto`` text."""
    major, minor = self.compute_capability
    rt = self.cuda_runtime
    v = self.cudnn_version
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {self.core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_bytes}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
runtime_version {{ major: {rt[0]} minor: {rt[1]} patch: {rt[2]} }}
platform_name: "CUDA"
dnn_version_info {{ major: {v // 10000} minor: {v // 100 % 100} patch: {v % 100} }}
device_description_str: "{self.device_kind}"
"""


# NVIDIA's published H100 SXM5 80GB figures (132 SMs, 3.35 TB/s, 50 MiB L2, 1.98 GHz boost,
# 227 KiB opt-in shared memory per block); memory_bytes (79.1 GiB) as a public XLA target
# config of an "NVIDIA H100 80GB HBM3" gives it, not read off our H100.
TARGETS: dict[str, Target] = {
    "h100": Target(name="h100", device_kind="NVIDIA H100 80GB HBM3",
                   compute_capability=(9, 0), cudnn_version=90800,
                   cuda_runtime=(12, 8, 0), memory_bytes=84_929_347_584, core_count=132,
                   memory_bandwidth=3_352_320_000_000, l2_cache_bytes=52_428_800,
                   clock_rate_ghz=1.98, shared_memory_per_block_optin=232_448,
                   shared_memory_per_core=233_472),
}

DEVICELESS_XLA_FLAGS = "--xla_gpu_enable_triton_gemm=false"
_active: Target | None = None


class TargetUnavailable(RuntimeError):
  """The compile target cannot be had here (no CUDA plugin, or it offers no topology)."""


def resolve(name: str) -> Target:
  """The :class:`Target` called ``name``; ValueError naming the known ones."""
  if name not in TARGETS:
    raise ValueError(f"compile target {name!r}: unknown (known: {', '.join(TARGETS)})")
  return TARGETS[name]


@functools.lru_cache(maxsize=None)
def device(name: str):
  """The simulated device of target ``name`` (a one-device CUDA topology, no GPU needed).
  :class:`TargetUnavailable` with the fix when jax's CUDA plugin is missing or failed."""
  target = resolve(name)
  try:  # the compiler lives in the plugin: CUDA 13's (the GPU machines' image) or 12's
    importlib.import_module("jax_plugins.xla_cuda13")
  except ImportError:
    try:
      importlib.import_module("jax_plugins.xla_cuda12")
    except ImportError as e:
      raise TargetUnavailable(
          f"compile target {name!r} needs jax's CUDA plugin: pip install "
          f"\"jax-cuda12-plugin=={jax.__version__}\" (the compiler only; no GPU, driver "
          "or CUDA libraries needed)") from e
  # Without a device there is no autotuning, and XLA 0.10's untuned Triton GEMM fusions
  # can fail to tile ("Couldn't find output tile sizes"): every matmul goes to cuBLAS, as
  # most large ones do on the GPU after autotuning. The plugin's XLA reads its flags once,
  # when it loads, which is below.
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_gpu_enable_triton_gemm" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " " + DEVICELESS_XLA_FLAGS).strip()
  from jax._src import xla_bridge
  if not xla_bridge.backends_are_initialized() and not jax.config.jax_platforms:
    # without a GPU the plugin fails to initialise as a backend, and then offers no
    # topology; the CPU as the only backend leaves it loaded as a compiler
    jax.config.update("jax_platforms", "cpu")
  from jax.experimental import topologies
  try:
    topology = topologies.get_topology_desc(
        "lowmem-" + name, "cuda", target_config=target.config_text(), topology="1x1x1")
  except Exception as e:
    raise TargetUnavailable(
        f"compile target {name!r}: jax's CUDA plugin gave no deviceless topology "
        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); on a machine "
        "without a GPU start with JAX_PLATFORMS=cpu") from e
  return topology.devices[0]


@contextlib.contextmanager
def compiling_for(name: str | None) -> Iterator[Target | None]:
  """Compiles inside target GPU ``name`` (None: the local backend, nothing changes)."""
  global _active
  if name is None:
    yield None
    return
  target = resolve(name)
  device(name)  # fail here, before any work, if it cannot be had
  previous, _active = _active, target
  try:
    with _cudnn_answers_for(target):
      yield target
  finally:
    _active = previous


@contextlib.contextmanager
def _cudnn_answers_for(target: Target) -> Iterator[None]:
  """Within: jax's cuDNN attention asks ``target`` for the cuDNN version and the compute
  capability it checks a call against. Outside, it asks the cuDNN library installed here
  (none with the plugin alone: "cuDNN not found") and the local backend (the CPU: never
  Hopper). The target's are the ones the executable is for."""
  from jax._src.cudnn import fused_attention_stablehlo as fmha

  def at_least(capability: str) -> bool:
    return target.compute_capability >= tuple(int(x) for x in capability.split("."))

  def equal(capability: str) -> bool:
    return target.compute_capability == tuple(int(x) for x in capability.split("."))

  answers = {"check_cudnn_version": lambda: target.cudnn_version,
             "check_compute_capability": at_least,
             "is_cuda_compute_capability_equal": equal}
  saved = {name: getattr(fmha, name) for name in answers if hasattr(fmha, name)}
  for name in saved:
    setattr(fmha, name, answers[name])
  try:
    yield
  finally:
    for name, fn in saved.items():
      setattr(fmha, name, fn)


def active() -> Target | None:
  """The target being compiled for, None for the local backend."""
  return _active


def bytes_limit() -> int | None:
  """What the target would report as ``memory_stats()['bytes_limit']`` to this process:
  its memory times ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (jax's default 0.75); None when no
  target is active."""
  if _active is None:
    return None
  fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
  return int(_active.memory_bytes * fraction)


def backend() -> str:
  """The backend a compile is for: ``"gpu"`` under :func:`compiling_for`, else jax's."""
  return jax.default_backend() if _active is None else "gpu"


def platform() -> tuple[str, int, tuple[int, int]] | None:
  """``(backend, cuDNN version, compute capability)`` of the target under
  :func:`compiling_for`; None otherwise (the caller asks the local backend)."""
  if _active is None:
    return None
  return "gpu", _active.cudnn_version, _active.compute_capability


def place(tree):
  """``tree``'s arrays as ShapeDtypeStructs on the target device, under
  :func:`compiling_for`; ``tree`` unchanged otherwise."""
  if _active is None:
    return tree
  sharding = jax.sharding.SingleDeviceSharding(device(_active.name))

  def one(x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      return x
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
  return jax.tree.map(one, tree)
