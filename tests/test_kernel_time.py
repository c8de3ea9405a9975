"""train.kernel_time: a traced step's device time by kernel kind and source line."""

import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData

from train import kernel_time
from train.kernel_time import Kernel

# kernel names as the H100's traces name them (cuBLAS, cuBLASLt, CUTLASS, XLA's Triton
# GEMMs, cuDNN's fused attention, torch's SDPA and elementwise kernels, XLA's fusions)
NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "matmul",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN": "matmul",
    "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8": "matmul",
    "gemm_fusion_dot_123_0": "matmul",
    "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc": "matmul",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x64x128": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>":
        "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)":
        "attention",
    "Memcpy DtoD (Device -> Device)": "copy",
    "Memset (Device)": "copy",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>": "copy",
    "loop_convert_fusion": "other",  # "conv" in "convert" is no convolution
    "void cudnn::cnn::conv2d_grouped_direct_kernel<float>": "matmul",
    "input_reduce_fusion_3": "other",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>": "other",
    "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>>": "other",
}


@pytest.mark.parametrize("name", NAMES)
def test_kind_from_the_kernel_name(name):
  assert kernel_time.kind(name) == NAMES[name]


def test_busy_time_is_the_union_of_intervals():
  ks = [Kernel("a", "", 0, 10), Kernel("b", "", 5, 10),    # overlap: [0, 15)
        Kernel("c", "", 6, 2),                             # inside it
        Kernel("d", "", 20, 5), Kernel("e", "", 25, 1)]    # a gap, then touching: [20, 26)
  assert kernel_time.busy_ns(ks) == 15 + 6
  assert kernel_time.busy_ns(reversed(ks)) == 21  # order of the list does not matter
  assert kernel_time.busy_ns([]) == 0


def test_summarize_per_step_by_kind_and_source():
  ms = 1e6  # ns
  ks = [Kernel("nvjet_tst_gemm", "custom-call.1", 0, 4 * ms),
        Kernel("loop_fusion", "fusion.2", 4 * ms, 1 * ms),
        Kernel("loop_fusion", "fusion.3", 5 * ms, 1 * ms),
        Kernel("Memcpy DtoD", "", 7 * ms, 2 * ms)] * 2  # two steps' kernels (same times)
  sources = {"custom-call.1": "models/linear.py:40 (__call__)",
             "fusion.2": "lowmem_jax/norms.py:10 (layer_norm)",
             "fusion.3": "lowmem_jax/norms.py:10 (layer_norm)"}
  p = kernel_time.summarize(ks, steps=2, wall_s=20e-3, where=sources.get)
  assert p["steps"] == 2 and p["wall_ms"] == pytest.approx(10.0)
  assert p["busy_ms"] == pytest.approx(4.0)  # the union of one step's 8 ms, over 2 steps
  assert p["idle_ms"] == pytest.approx(6.0)
  assert p["kernel_ms"] == pytest.approx(8.0) and p["kernels_per_step"] == 4
  assert p["kind_ms"] == pytest.approx({"matmul": 4.0, "attention": 0.0, "copy": 2.0,
                                        "other": 2.0})
  assert p["attributed"] == pytest.approx(6 / 8)  # of kernel time: the copy has no source
  assert [(t["where"], t["ms"], t["kernels"], t["kind"]) for t in p["top"]] == [
      ("models/linear.py:40 (__call__)", pytest.approx(4.0), 1, "matmul"),
      ("lowmem_jax/norms.py:10 (layer_norm)", pytest.approx(2.0), 2, "other"),
      ("Memcpy DtoD", pytest.approx(2.0), 1, "copy")]  # no op: the kernel's name
  assert len(kernel_time.summarize(ks, 2, 0.02, top=1)["top"]) == 1
  # XLA:GPU's CUDA graphs: the event's op is the graph's thunk, not an HLO instruction;
  # a fusion's kernel is placed by its name, a library GEMM's is labelled by its name
  graph = [Kernel("loop_add_fusion_1", "command_buffer_7", 0, 3 * ms),
           Kernel("nvjet_tst_gemm", "command_buffer_7", 3 * ms, 1 * ms)]
  g = kernel_time.summarize(graph, 1, 4e-3, where={
      "loop_add_fusion_1": "lowmem_jax/quant.py:9 (pack) [fwd]"}.get)
  assert g["attributed"] == pytest.approx(3 / 4)
  assert [t["where"] for t in g["top"]] == ["lowmem_jax/quant.py:9 (pack) [fwd]",
                                            "nvjet_tst_gemm"]
  with pytest.raises(ValueError, match="steps must be >= 1"):
    kernel_time.summarize(ks, 0, 1.0)
  text = kernel_time.table({"ours": p})
  assert text.splitlines()[0].split()[:4] == ["run", "wall", "ms", "busy"]
  assert text.splitlines()[-1].split()[:8] == ["ours", "10.00", "4.00", "6.00", "4.00",
                                               "0.00", "2.00", "2.00"]
  assert "models/linear.py:40" in kernel_time.top_table("ours", p)


XSPACE = """
planes {
  id: 1 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(Compute)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000
      stats { metadata_id: 1 ref_value: 3 } stats { metadata_id: 2 str_value: "jit_step" } }
    events { metadata_id: 2 offset_ps: 6000000 duration_ps: 1000000 } }
  lines { id: 2 name: "Stream #14(MemcpyD2D)" timestamp_ns: 1000
    events { metadata_id: 3 offset_ps: 2000000 duration_ps: 2000000 } }
  lines { id: 3 name: "XLA Ops" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 } }
  event_metadata { key: 1 value { id: 1 name: "sm90_xmma_gemm_bf16" } }
  event_metadata { key: 2 value { id: 2 name: "loop_fusion" } }
  event_metadata { key: 3 value { id: 3 name: "Memcpy DtoD" } }
  stat_metadata { key: 1 value { id: 1 name: "hlo_op" } }
  stat_metadata { key: 2 value { id: 2 name: "hlo_module" } }
  stat_metadata { key: 3 value { id: 3 name: "dot.5" } }
}
planes {
  id: 2 name: "/host:CPU"
  lines { id: 1 name: "python" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 0 duration_ps: 9000000 } }
  event_metadata { key: 1 value { id: 1 name: "train_step" } }
}
"""


def test_kernels_of_a_device_plane_streams_only():
  profile = ProfileData.from_serialized_xspace(
      ProfileData.text_proto_to_serialized_xspace(XSPACE))
  ks = kernel_time.kernels_of(profile)
  # the derived "XLA Ops" line and the host plane are not kernels
  assert ks == [Kernel("sm90_xmma_gemm_bf16", "dot.5", 1000.0, 5000.0),
                Kernel("loop_fusion", "", 7000.0, 1000.0),
                Kernel("Memcpy DtoD", "", 3000.0, 2000.0)]
  assert kernel_time.busy_ns(ks) == 6000.0


def test_a_cpu_trace_has_no_device_kernels():
  f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  x = jnp.ones((64, 64))
  f(x).block_until_ready()
  calls = []

  def run():
    calls.append(1)
    return [f(x) for _ in range(2)]
  if jax.default_backend() == "cpu":
    assert kernel_time.trace_steps(run, 2) is None and calls == [1]
  else:  # a GPU trace: the two steps' kernels
    p = kernel_time.trace_steps(run, 2)
    assert p["kernels_per_step"] >= 1 and p["busy_ms"] > 0


def test_hlo_sources_name_the_python_line_and_the_phase():
  def body(x):
    return jnp.sin(x) * 2.0  # the line the instruction comes from

  compiled = jax.jit(body).lower(jnp.ones(8)).compile()
  where = kernel_time.hlo_sources(compiled.as_text())
  from lowmem_jax.buffer_assignment import HloText
  ops = [i.name for i in HloText(compiled.as_text()).instrs.values()
         if i.opcode in ("fusion", "sine", "multiply")]
  assert ops and any("test_kernel_time.py" in where(op) and where(op).endswith("[fwd]")
                     for op in ops)
  assert where("no-such-op.1") == ""
  # a kernel's name (XLA names a fusion's kernel after it, "." and "-" as "_") finds it
  fusion = next(op for op in ops if "." in op or "-" in op)
  kernel_name = fusion.replace(".", "_").replace("-", "_")
  assert kernel_name != fusion and where(kernel_name) == where(fusion) != ""

  # the gradient of a rematted function: its backward and its recomputed forward
  step = jax.jit(jax.grad(lambda x: jax.checkpoint(lambda y: jnp.sin(jnp.sin(y)))(x).sum()))
  hlo = step.lower(jnp.ones(8)).compile().as_text()
  where = kernel_time.hlo_sources(hlo)
  phases = {where(i.name).rsplit(" ", 1)[-1] for i in HloText(hlo).instrs.values()
            if where(i.name) and i.opcode not in ("parameter", "constant") and i.op_name}
  # an instruction XLA made, without JAX's op name (0.11: a broadcast), gets no phase
  assert all(not where(i.name).endswith("]") for i in HloText(hlo).instrs.values()
             if not i.op_name)
  assert phases and phases <= {"[bwd]", "[bwd+recompute]"}, phases  # grad alone: no fwd
  if jax.default_backend() == "cpu":  # unfused, the recomputed sin and cos show (a GPU
    assert "[bwd+recompute]" in phases  # fusion may carry its backward root's name)


class _Range:
  def __init__(self, start, end):
    self.start, self.end = start, end


class _Event:
  def __init__(self, name, device, start_us, end_us):
    self.name, self.device_type = name, device
    self.time_range = _Range(start_us, end_us)


def test_torch_kernels_are_the_cuda_events():
  events = [_Event("aten::mm", "DeviceType.CPU", 0.0, 50.0),
            _Event("nvjet_tst_gemm", "DeviceType.CUDA", 10.0, 30.0),
            _Event("Memset (Device)", "DeviceType.CUDA", 31.0, 32.5)]
  assert kernel_time.torch_kernels(events) == [
      Kernel("nvjet_tst_gemm", "", 10e3, 20e3), Kernel("Memset (Device)", "", 31e3, 1.5e3)]
