"""lowmem_jax.hlo_kernels: kernel launches and stack copies of a compiled step."""

import jax
import jax.numpy as jnp
import pytest

from lowmem_jax.hlo_kernels import async_overlaps, count_kernels
from lowmem_jax.layers import Scanned, Unrolled
from test_buffer_assignment import _GPU_HLO  # an XLA:GPU 0.11 excerpt: async-wrapped fusion

# Cut from XLA:GPU's optimized HLO of a scanned ViT-B step (deviceless H100 compile, XLA
# 0.10.2), names kept, metadata dropped: a while of 12 trips whose body writes a residual
# into its stack (a copy, then dynamic-update-slice), reads a weight slice out (a
# dynamic-slice, then copy), casts another slice (dynamic-slice fused into a convert: work,
# not a copy) and runs a cuBLAS matmul; the entry runs one more fusion.
GPU_EXCERPT = """\
HloModule jit_step, entry_computation_layout={()->f32[]}

%fused_dynamic_update_slice.2 (param_0.8: bf16[12,64,197,3072], param_1.7: s32[], param_2.351: bf16[12608,3072]) -> bf16[12,64,197,3072] {
  %param_0.8 = bf16[12,64,197,3072]{3,2,1,0} parameter(0)
  %param_2.351 = bf16[12608,3072]{1,0} parameter(2)
  %bitcast.106.1 = bf16[1,64,197,3072]{3,2,1,0} bitcast(%param_2.351)
  %copy.193 = bf16[1,64,197,3072]{3,2,1,0} copy(%bitcast.106.1)
  %param_1.7 = s32[] parameter(1)
  %constant_457_6 = s32[] constant(0)
  ROOT %dynamic_update_slice.72.1 = bf16[12,64,197,3072]{3,2,1,0} dynamic-update-slice(%param_0.8, %copy.193, %param_1.7, %constant_457_6, %constant_457_6, /*index=5*/%constant_457_6)
}

%fused_dynamic_slice.26 (param_0.757: f32[12,3072,768], param_1.951: s32[]) -> f32[1,3072,768] {
  %param_0.757 = f32[12,3072,768]{2,1,0} parameter(0)
  %constant_453_24 = s32[] constant(11)
  %param_1.951 = s32[] parameter(1)
  %subtract.24 = s32[] subtract(%constant_453_24, %param_1.951)
  %constant_162_23 = s32[] constant(0)
  %dynamic_slice.85.1 = f32[1,3072,768]{2,1,0} dynamic-slice(%param_0.757, %subtract.24, %constant_162_23, %constant_162_23), dynamic_slice_sizes={1,3072,768}
  ROOT %copy.228 = f32[1,3072,768]{2,1,0} copy(%dynamic_slice.85.1)
}

%fused_convert.3 (param_0.1: f32[12,768,3072], param_1.1: s32[]) -> bf16[768,3072] {
  %param_0.1 = f32[12,768,3072]{2,1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %constant_1 = s32[] constant(0)
  %dynamic_slice.1 = f32[1,768,3072]{2,1,0} dynamic-slice(%param_0.1, %param_1.1, %constant_1, %constant_1), dynamic_slice_sizes={1,768,3072}
  %bitcast.1 = f32[768,3072]{1,0} bitcast(%dynamic_slice.1)
  ROOT %convert.1 = bf16[768,3072]{1,0} convert(%bitcast.1)
}

%region_0.23 (arg_tuple.1: (s32[], bf16[12,64,197,3072], f32[12,3072,768], f32[12,768,3072], bf16[12608,768])) -> (s32[], bf16[12,64,197,3072], f32[12,3072,768], f32[12,768,3072], bf16[12608,768]) {
  %arg_tuple.1 = (s32[], bf16[12,64,197,3072]{3,2,1,0}, f32[12,3072,768]{2,1,0}, f32[12,768,3072]{2,1,0}, bf16[12608,768]{1,0}) parameter(0)
  %get-tuple-element.1 = s32[] get-tuple-element(%arg_tuple.1), index=0
  %get-tuple-element.2 = bf16[12,64,197,3072]{3,2,1,0} get-tuple-element(%arg_tuple.1), index=1
  %get-tuple-element.3 = f32[12,3072,768]{2,1,0} get-tuple-element(%arg_tuple.1), index=2
  %get-tuple-element.4 = f32[12,768,3072]{2,1,0} get-tuple-element(%arg_tuple.1), index=3
  %get-tuple-element.5 = bf16[12608,768]{1,0} get-tuple-element(%arg_tuple.1), index=4
  %wrapped_convert.9 = bf16[768,3072]{1,0} fusion(%get-tuple-element.4, %get-tuple-element.1), kind=kLoop, calls=%fused_convert.3
  %cublas-lt-matmul.4 = (bf16[12608,3072]{1,0}, s8[4194304]{0}) custom-call(%get-tuple-element.5, %wrapped_convert.9), custom_call_target="__cublas$lt$matmul"
  %get-tuple-element.6 = bf16[12608,3072]{1,0} get-tuple-element(%cublas-lt-matmul.4), index=0
  %loop_dynamic_update_slice_fusion.2 = bf16[12,64,197,3072]{3,2,1,0} fusion(%get-tuple-element.2, %get-tuple-element.1, %get-tuple-element.6), kind=kCustom, calls=%fused_dynamic_update_slice.2
  %loop_dynamic_slice_fusion.26 = f32[1,3072,768]{2,1,0} fusion(%get-tuple-element.3, %get-tuple-element.1), kind=kLoop, calls=%fused_dynamic_slice.26
  ROOT %tuple.1 = (s32[], bf16[12,64,197,3072]{3,2,1,0}, f32[12,3072,768]{2,1,0}, f32[12,768,3072]{2,1,0}, bf16[12608,768]{1,0}) tuple(%get-tuple-element.1, %loop_dynamic_update_slice_fusion.2, %get-tuple-element.3, %get-tuple-element.4, %get-tuple-element.5)
}

%fused_add.1 (param_0.2: f32[]) -> f32[] {
  %param_0.2 = f32[] parameter(0)
  ROOT %add.1 = f32[] add(%param_0.2, %param_0.2)
}

ENTRY %main.101 (p0: (s32[], bf16[12,64,197,3072], f32[12,3072,768], f32[12,768,3072], bf16[12608,768]), p1: f32[]) -> f32[] {
  %p0 = (s32[], bf16[12,64,197,3072]{3,2,1,0}, f32[12,3072,768]{2,1,0}, f32[12,768,3072]{2,1,0}, bf16[12608,768]{1,0}) parameter(0)
  %p1 = f32[] parameter(1)
  %while.1 = (s32[], bf16[12,64,197,3072]{3,2,1,0}, f32[12,3072,768]{2,1,0}, f32[12,768,3072]{2,1,0}, bf16[12608,768]{1,0}) while(%p0), condition=%region_cond, body=%region_0.23, backend_config={"known_trip_count":{"n":"12"},"known_init_step":{"init":"0","step":"1"}}
  ROOT %loop_add_fusion = f32[] fusion(%p1), kind=kLoop, calls=%fused_add.1
}
"""


def test_counts_a_scan_body_per_trip_and_its_stack_copies():
  k = count_kernels(GPU_EXCERPT)
  assert k.loop_trips == (12,)
  # per trip: convert fusion, matmul, DUS fusion, DS fusion; once: the entry's fusion
  assert k.launches == 12 * 4 + 1
  assert k.stack_copies == 12 * 2  # the convert that slices a weight is work, not a copy
  write = 64 * 197 * 3072 * 2      # one layer's bf16 residual into the stack
  read = 3072 * 768 * 4            # one layer's fp32 weight out of it
  assert k.stack_copy_bytes == 12 * 2 * (write + read)


def test_counts_the_fusion_an_async_pair_runs():
  """XLA:GPU 0.11 wraps fusions in async-start / async-done: the fusion inside is the
  launch (here a dynamic-update-slice of an f32[8] row into an f32[6,8] stack), beside
  the entry's fusion and copy."""
  k = count_kernels(_GPU_HLO)
  assert (k.launches, k.stack_copies, k.stack_copy_bytes, k.loop_trips) == (3, 1, 2 * 8 * 4, ())


_CALL_ON_STREAM_HLO = """HloModule m, is_scheduled=true

%fused (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  ROOT %e = f32[8]{0} exponential(%q)
}

%body (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %fusion.a = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused
  ROOT %fusion.b = f32[8]{0} fusion(%fusion.a), kind=kLoop, calls=%fused
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %call-start = ((f32[8]{0}), f32[8]{0}) call-start(%x), async_execution_thread="main", to_apply=%body, frontend_attributes={_xla_stream_annotation="1",inlineable="false"}
  %fusion.1 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused
  %call-done = f32[8]{0} call-done(%call-start)
  ROOT %fusion.2 = f32[8]{0} fusion(%call-done), kind=kLoop, calls=%fused
}
"""


def test_counts_what_a_call_on_another_stream_runs():
  """``compute_on("gpu_stream:1")`` (reversible=pareprop-stream) compiles to call-start
  with ``to_apply``: its two fusions launch beside the entry's two (they were not
  counted: 2)."""
  assert count_kernels(_CALL_ON_STREAM_HLO).launches == 4


def test_counts_the_branch_of_a_conditional_that_launches_most():
  """lax.cond: one branch runs a step; the launches of the larger one count, not none
  (they were not counted) and not both's. The entry's conversion is the other launch."""
  hlo = _CALL_ON_STREAM_HLO.split("ENTRY")[0] + """%one (p: f32[8]) -> f32[8] {
  %p.1 = f32[8]{0} parameter(0)
  ROOT %fusion.c = f32[8]{0} fusion(%p.1), kind=kLoop, calls=%fused
}

ENTRY %main (k: s32[], x: f32[8]) -> f32[8] {
  %k = s32[] parameter(0)
  %x = f32[8]{0} parameter(1)
  %fusion.k = s32[] fusion(%k), kind=kLoop, calls=%fused
  ROOT %cond = f32[8]{0} conditional(%fusion.k, %x, %x), branch_computations={%one, %body}
}
"""
  assert count_kernels(hlo).launches == 3


def test_a_module_without_entry_is_an_error():
  with pytest.raises(ValueError, match="no ENTRY"):
    count_kernels("HloModule m\n")


def test_unrolled_layers_launch_no_loop():
  """A scanned stack compiles to a loop that runs its body once per layer; unrolled, the
  same layers are straight-line code (the local backend's compile)."""
  w = jnp.ones((3, 16, 16)) * 0.1

  def loss(strategy, w, x):
    carry, _ = strategy(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)
    return carry.sum()

  x = jnp.ones((4, 16))
  texts = {name: jax.jit(jax.grad(lambda w, x, s=s: loss(s, w, x))).lower(w, x).compile()
           .as_text() for name, s in (("scan", Scanned()), ("unrolled", Unrolled()))}
  assert count_kernels(texts["scan"]).loop_trips == (3, 3)  # forward and backward
  unrolled = count_kernels(texts["unrolled"])
  assert unrolled.loop_trips == () and unrolled.stack_copies == 0 and unrolled.launches > 0


def test_async_overlaps_count_the_launches_between_start_and_done():
  """A call on stream 1 with two fusions and a copy scheduled before its done overlaps 3
  launches (the scalar constant runs nothing); a host copy with one before its done, 1.
  Async pairs on the main stream are left out: the 0.11 excerpt's async-wrapped fusion,
  an async fusion on operation queue 0 with a launch inside its pair (as 0.11.2 compiles
  RevViT's gradient stacks), and a call without an annotation."""
  assert async_overlaps(_GPU_HLO) == {}
  hlo = """HloModule m, is_scheduled=true

%body (p: f32[8]) -> f32[8] {
  ROOT %p = f32[8]{0} parameter(0)
}

%fused (q: f32[8]) -> f32[8] {
  ROOT %q = f32[8]{0} parameter(0)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %call-start = ((f32[8]{0}), f32[8]{0}) call-start(%x), async_execution_thread="main", \
to_apply=%body, frontend_attributes={_xla_stream_annotation="1",inlineable="false"}
  %fusion.1 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused
  %c = s32[] constant(1)
  %fusion.2 = f32[8]{0} fusion(%fusion.1), kind=kLoop, calls=%fused
  %copy.1 = f32[8]{0} copy(%fusion.2)
  %call-done = f32[8]{0} call-done(%call-start)
  %fusion-start = ((f32[8]{0}), f32[8]{0}, u32[]) fusion-start(%call-done), kind=kLoop, \
calls=%fused, backend_config={"operation_queue_id":"0","force_earliest_schedule":false}
  %fusion.3 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused
  %fusion-done = f32[8]{0} fusion-done(%fusion-start)
  %call-start.1 = ((f32[8]{0}), f32[8]{0}) call-start(%fusion-done), to_apply=%body
  %fusion.4 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused
  %call-done.1 = f32[8]{0} call-done(%call-start.1)
  %copy-start = (f32[8]{0:S(5)}, f32[8]{0}, u32[]) copy-start(%call-done.1)
  %fusion.5 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused
  %copy-done = f32[8]{0:S(5)} copy-done(%copy-start)
  ROOT %fusion.6 = f32[8]{0} fusion(%fusion.5), kind=kLoop, calls=%fused
}
"""
  assert async_overlaps(hlo) == {"call-start": 3, "copy-start": 1}
