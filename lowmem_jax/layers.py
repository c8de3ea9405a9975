"""How a stack of blocks runs: the ``layers`` field.

``layers="scan"`` (the default) runs the blocks with ``lax.scan``: the program holds one
block however deep the model, and each iteration's work stays inside its iteration, so
XLA cannot spread a layer's backward over the others. Its cost on a GPU: a scan stacks
every residual of every layer into one ``[layers, ...]`` buffer, and XLA:GPU writes each
into it with a ``dynamic-update-slice`` in the forward and reads it out with a
``dynamic-slice`` in the backward (a cuBLAS matmul or cuDNN call can neither write into
nor read from a slice of a stacked buffer: each is a copy). Compiled for an H100 (XLA
0.10.2, ViT-B/16 LoRA batch 64, ``baseline``): 348 such copy kernels and 8044 MiB read
and written per step, about 3.3 ms at the H100's measured 2.55 TB/s, in a step of 36 ms
(``docs/h100_compiled.md``; :mod:`lowmem_jax.hlo_kernels` counts them). The recomputes
in a scanned layer run without ``jax.checkpoint``'s CSE barrier (:func:`checkpoint`),
which there only added copies (10466 MiB with it).

``layers="unrolled"`` runs the blocks in a Python loop, each layer its own slice of the
stacked variables: no stacked residuals and no copies (the same step: 810 kernel
launches in place of 1236, temp 2602 MiB in place of 2733), at the price of compile
time that grows with depth (LLaMA-7B, 32 layers, compiled for an H100 on a 2-core CPU:
207 s against the scan's 10.5). Left alone, XLA:GPU schedules an unrolled program's layers
into each other (under ``lowmem`` it computed every layer's 8-bit codes late, their bf16
inputs all live at once: temp 1932 MiB against the scan's 913), so each layer runs as
:func:`ordered`: what its backward keeps is ready before its output is, and its
backward starts only once its output's cotangent has arrived, as inside a scan
(``lowmem``: 1054 MiB); its weights' gradients are computed before the previous
layer's backward starts. A frozen weight's slice is not kept for the backward either:
the backward slices the stacked weight again (:func:`ordered`'s ``layer_of``), as the
scan's backward loop does; kept, XLA held every layer's slices (or their bf16 casts)
from forward to backward (``lowmem+qkv=recompute``: temp 848 MiB, 626 without; 532
with the weight gradients in order too, against the scan's 557). Where a
policy keeps codes rather than bf16 residuals (Mesa), the scan copies almost nothing
and unrolling only saves launches. An unrolled step is compiled without two XLA passes
that merge the layers' bf16 casts of their weight slices into one cast of the whole
stack (:data:`UNROLLED_DISABLED_PASSES`; the policy's ``compiler_options``).

Both keep the same values (the same blocks, the same per-layer state) and give the same
gradients; what a policy saves is unchanged; only how XLA lays the step out differs.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from lowmem_jax.methods import Field, Method, Strategy

LAYERS = ("scan", "unrolled")

# True while a scanned layer's body is traced (Scanned below)
_IN_SCAN = contextvars.ContextVar("lowmem_jax_in_scanned_layer", default=False)


def checkpoint(fn: Callable, policy: Callable | None = None) -> Callable:
  """``jax.checkpoint(fn, policy=policy)``, whose ``prevent_cse`` is decided where it is
  called: off inside a scanned layer, on elsewhere.

  ``prevent_cse`` wraps what the recompute reads in an optimization barrier, so that XLA
  cannot merge the recompute with the forward's copy of the same work (which would keep
  that copy from forward to backward). A scanned layer's forward and backward are two
  loops: nothing can merge, and the barrier only forces its inputs into buffers of their
  own. On XLA:GPU that was a copy of every frozen weight's slice out of its stack before
  its cast, each layer, in backward (LLaMA-7B widths, 4 layers, LoRA: 6189 MiB a step).

  Called with Flax NNX modules (a user's block: ``policy.remat_block(lambda m, x: m(x))``,
  or a module's own method), it is ``nnx.remat``, which writes back the state the block
  updates (Mesa's ranges, WTA-CRS's key counts); ``jax.checkpoint`` would run the block on
  a copy and drop it. States and variables (a block stack's layer) go to
  ``jax.checkpoint``."""
  @functools.wraps(fn)
  def run(*args, **kwargs):
    prevent_cse = not _IN_SCAN.get()
    nnx = _nnx()
    if nnx is not None:  # a module's state updates go back to it (nnx.remat)
      target, inputs = fn, args
      if inspect.ismethod(fn):  # nnx.remat takes no bound method: its module is an input
        if isinstance(fn.__self__, nnx.Module):
          target, inputs = fn.__func__, (fn.__self__, *args)
        else:
          target = lambda *a, **k: fn(*a, **k)  # noqa: E731
      if any(isinstance(leaf, nnx.Module) for leaf in jax.tree.leaves(
          (inputs, kwargs), is_leaf=lambda x: isinstance(x, nnx.Module))):
        return nnx.remat(target, policy=policy, prevent_cse=prevent_cse)(*inputs, **kwargs)
    return jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)(*args, **kwargs)
  return run


def _nnx():
  """``flax.nnx`` where Flax is imported (lowmem_jax does not import it), else None."""
  return sys.modules.get("flax.nnx")


@dataclasses.dataclass(frozen=True)
class Scanned(Strategy):
  """``(step, carry, xs) -> (carry, ys)``: ``lax.scan`` over the layer axis of ``xs``;
  the recomputes traced in its body skip the CSE barrier (:func:`checkpoint`)."""

  def __call__(self, step: Callable, carry, xs):
    def body(carry, x):
      inside = _IN_SCAN.set(True)
      try:
        return step(carry, x)
      finally:
        _IN_SCAN.reset(inside)
    return jax.lax.scan(body, carry, xs)


@dataclasses.dataclass(frozen=True)
class Unrolled(Strategy):
  """``(step, carry, xs) -> (carry, ys)`` as ``lax.scan`` computes it, in a Python loop:
  layer ``i`` gets ``xs`` sliced at ``i``, each layer runs :func:`ordered` (its frozen
  slices taken again from ``xs`` in backward), and the ``ys`` are stacked after the
  loop."""

  def __call__(self, step: Callable, carry, xs):
    length = {x.shape[0] for x in jax.tree.leaves(xs)}
    if len(length) != 1:
      raise ValueError(f"Unrolled: the stacked inputs disagree on the layer count {length}")
    ys = []
    for i in range(length.pop()):
      layer = jax.tree.map(lambda x, i=i: x[i], xs)
      carry, y = ordered(step, layer_of=i)(carry, layer, xs)
      ys.append(y)
    return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)


def ordered(fn: Callable, layer_of: int | None = None) -> Callable:
  """``fn`` with the same values and gradients, whose backward keeps what ``jax.vjp``
  of ``fn`` keeps (for the inputs being differentiated only) and runs in order:

  * forward: the kept tensors and the output leave through one optimization barrier,
    so everything ``fn``'s backward keeps is computed before its output is used;
  * backward: the kept tensors and the output cotangent pass one barrier, so none of
    the backward's work (a dequantization, a recompute) starts before the cotangent;
    and the cotangents of all its inputs leave through another, so a weight's gradient
    is computed before the previous layer's backward starts (XLA deferred LoRA's
    weight gradients, keeping their bf16 inputs: 922 MiB at the peak at LLaMA-7B
    widths, 4 layers, under ``lowmem``).

  Inputs that ``fn``'s backward keeps as they are (a frozen weight's slice) stay out of
  the barriers: held through one, each would be a copy kept from forward to backward.
  ``layer_of=i``: the wrapped function takes one more, last, argument, the stacked tree
  whose slice at ``i`` is ``fn``'s last argument (``fn`` does not see it). A slice of
  it that ``fn``'s backward keeps as it is and that is not differentiated (a frozen
  weight's) is not kept: the backward takes it again from the stacked array, after
  the barrier. Kept, XLA held each such slice (or its bf16 cast) from forward to
  backward: 192 MiB of ViT-B/16 LoRA weights under ``lowmem+qkv=recompute`` (H100
  compile), where the stacked parameters are live anyway.
  One ``ordered(fn)`` per call site: the backward reads what its forward traced.
  """
  traced = {}

  @jax.custom_vjp
  def run(*args):
    return fn(*(args[:-1] if layer_of is not None else args))

  def fwd(*args):
    stacked = None
    if layer_of is not None:
      *args, stacked = args
      stacked = jax.tree.leaves(stacked, is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
      stacked = [p.value for p in stacked]
    primals, tree = jax.tree.flatten(tuple(args),
                                     is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
    values = [p.value for p in primals]
    moving = [i for i, p in enumerate(primals) if p.perturbed]

    def of_moving(*diff):
      full = list(values)
      for i, d in zip(moving, diff):
        full[i] = d
      return fn(*jax.tree.unflatten(tree, full))

    out, pullback = jax.vjp(of_moving, *(values[i] for i in moving))
    kept, kept_tree = jax.tree.flatten(pullback)
    inputs = {id(v) for v in values}
    fenced = [j for j, k in enumerate(kept) if id(k) not in inputs]
    out, through = jax.lax.optimization_barrier((out, [kept[j] for j in fenced]))
    for j, k in zip(fenced, through):
      kept[j] = k
    # the last argument's leaves, frozen and kept as they are: sliced again in backward
    resliced = {}  # position in kept -> position in the stacked residuals
    if stacked is not None:
      first = len(values) - len(stacked)
      frozen = {id(values[first + n]): n for n in range(len(stacked))
                if first + n not in moving}
      needed = sorted({frozen[id(k)] for k in kept if id(k) in frozen})
      resliced = {j: needed.index(frozen[id(k)]) for j, k in enumerate(kept)
                  if id(k) in frozen}
      kept = [None if j in resliced else k for j, k in enumerate(kept)]
      stacked = [stacked[n] for n in needed]
    traced.update(tree=tree, moving=moving, kept_tree=kept_tree, fenced=fenced,
                  count=len(values), resliced=resliced)
    return out, (kept, stacked)

  def bwd(res, g):
    kept, stacked = res
    g, g_tree = jax.tree.flatten(g)
    # SymbolicZero: the cotangent of an output nothing downstream differentiates
    g = [_zeros(x.aval) if isinstance(x, SymbolicZero) else x for x in g]
    real = [i for i, x in enumerate(g) if x.dtype != jax.dtypes.float0]
    fenced = traced["fenced"]
    # the stacked arrays pass the barrier too: their slices here are taken after the
    # cotangent, not merged with the forward's (which would keep those again)
    through, g_real, stacked = jax.lax.optimization_barrier(
        ([kept[j] for j in fenced], [g[i] for i in real], stacked or []))
    kept = list(kept)
    for j, k in zip(fenced, through):
      kept[j] = k
    for j, m in traced["resliced"].items():
      kept[j] = stacked[m][layer_of]
    for i, x in zip(real, g_real):
      g[i] = x
    pullback = jax.tree.unflatten(traced["kept_tree"], kept)
    # the layer's cotangents leave together: its weights' gradients are computed before
    # the previous layer's backward gets its input's, not deferred with their inputs live
    grads = jax.lax.optimization_barrier(pullback(jax.tree.unflatten(g_tree, g)))
    full = [None] * traced["count"]  # None: a zero cotangent (an input not differentiated)
    for i, d in zip(traced["moving"], grads):
      full[i] = d
    out = jax.tree.unflatten(traced["tree"], full)
    if layer_of is not None:  # the stacked tree: fn does not read it, its cotangent is 0
      out = (*out, None)
    return tuple(out)

  run.defvjp(fwd, bwd, symbolic_zeros=True)
  return run


def _zeros(tangent):
  """A zero cotangent of type ``tangent`` (float0 for an integer or key input)."""
  if tangent.dtype == jax.dtypes.float0:
    return np.zeros(tangent.shape, jax.dtypes.float0)
  return jnp.zeros(tangent.shape, tangent.dtype)


def _layers(policy, inner):
  return Unrolled() if policy.layers == "unrolled" else Scanned()


# XLA passes an unrolled step is compiled without. An unrolled layer casts its slice of
# each stacked fp32 weight to bf16; XLA 0.11 rewrites the layers' casts of their slices
# into one cast of the whole stack (convert-mover moves a narrowing convert above the
# slice, slice-sinker sinks slices below the same elementwise op), whose bf16 copy of
# every layer's weights then lives from the first layer's forward on. Either pass alone
# does it. LLaMA-7B widths, 4 layers, LoRA on all linears, lowmem, compiled by 0.11.2 for
# an H100: temp 2298 MiB, 1442 without the two (the scan: 1622).
UNROLLED_DISABLED_PASSES = ("convert-mover", "slice-sinker")


def _compiler_options(policy) -> dict[str, str]:
  if policy.layers != "unrolled":
    return {}
  return {"xla_disable_hlo_passes": ",".join(UNROLLED_DISABLED_PASSES)}


def _check_model(policy, model: str, reversible: bool):
  if reversible and policy.layers != "scan":
    raise ValueError(f"{model}: layers={policy.layers!r} is for standard block stacks; a "
                     "reversible stack runs its own loop (lowmem_jax.reversible)")


METHOD = Method(
    name="layers",
    fields=(Field("layers", "scan", "scan (lax.scan over the stacked blocks: compile time "
                  "flat in depth; on a GPU each residual is copied into and out of its "
                  "stack) | unrolled (a Python loop over the layers, each in order: no "
                  "stacked residuals, compile time grows with depth)", choices=LAYERS),),
    strategies={"layers": _layers},
    check_model=_check_model,
    compiler_options=_compiler_options,
)
