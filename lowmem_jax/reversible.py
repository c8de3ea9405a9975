"""Reversible residual stacks (RevViT, CVPR 2022) with a PaReprop (arXiv 2306.09342) schedule.

Block ``i`` maps ``(x1, x2)`` to ``y1 = x1 + f(pf_i, x2, kf_i)``, ``y2 = x2 + g(pg_i, y1, kg_i)``
and is inverted exactly by ``x2 = y2 - g(pg_i, y1, kg_i)``, ``x1 = y1 - f(pf_i, x2, kf_i)``.
:func:`reversible_stack` is one ``jax.custom_vjp`` over the whole stack that saves for
backward only the final ``(y1, y2)``, the parameters and the key: nothing per layer, so
activation memory does not grow with depth. Backward rebuilds each block's inputs from
its outputs, replaying the same per-layer keys (dropout, drop-path) as forward.

Schedules of the backward scan (same gradients):

* ``"vanilla"`` (RevViT): per block, the VJP's forward of ``g`` and ``f`` also gives the
  rebuilt inputs, so a block costs one forward + one backward of ``f`` and ``g``.
* ``"pareprop"`` (PaReprop): iteration ``i`` takes the gradient of block ``i`` at inputs
  rebuilt one iteration earlier, and, independently of it, rebuilds block ``i-1``'s
  inputs by a plain forward inverse. With no data dependence between the two, a
  scheduler may run them concurrently (on GPU, separate streams). Price: one extra
  forward of ``f`` and ``g`` per block, as the rebuild no longer shares the VJP's forward
  (and one discarded rebuild in the last iteration). A prologue rebuilds block ``L-1``'s
  inputs before the loop.
* ``"pareprop-stream"``: PaReprop with the rebuild put on a second GPU stream by JAX's
  stream annotation (``compute_on`` with ``"gpu_stream:1"`` around one call: XLA runs it
  asynchronously beside the gradient work). Other backends ignore the annotation; the
  arithmetic is PaReprop's. Compiled for an H100 (jaxlib 0.10.2) it keeps more than
  ``"pareprop"`` (the rebuild's buffers beside the gradient's), and the schedule puts
  the call's start right before its done: no launch between them
  (:func:`lowmem_jax.hlo_kernels.async_overlaps`), also with the latency hiding
  scheduler, its analytical latency estimators, or an XLA ``_scheduling_group_id`` on
  both halves of the iteration (2026-11-26). XLA 0.11.2 (the GPU machines') schedules
  43 launches between them, at 664.5 against ``"pareprop"``'s 396.6 MiB of temp
  (RevViT-B, 12 layers, batch 32; ``docs/h100_compiled.md``). Its speed on a GPU is
  unmeasured so far: the H100 run of 2026-11-25 timed out before this variant
  (``benchmarks/reversible_depth``, ``docs/gpu/README.md``; there ``"pareprop"`` ran at
  0.81x vanilla's speed), and on jax 0.11 it crashed until the annotation went through
  the API both versions have (:func:`stream_call`).

Numerics: ``x = y - f(...)`` is exact in exact arithmetic; in floating point the rebuilt
inputs differ from the true ones by rounding, so gradients match standard backprop to
about 1e-5 in fp32, not bitwise. :func:`reference_stack` is the same stack under plain
autodiff (per-layer residuals), the baseline the tests compare against. The rebuild also
needs ``f`` and ``g`` to give in backward what they gave in forward: an output that
differs by one 16-bit rounding error of ``|f|`` is an error of that size in ``x``, large
where ``|f| >> |x|`` (RevLlama's first block: streams of the embedding's, max 0.07, beside
an ``|f|`` up to 2.7). "vanilla" takes ``f`` from the VJP's forward, which XLA compiles
beside the backward; elementwise 16-bit chains that a compiler may fuse differently per
program (a multiply-add into an FMA) must compute in fp32 and round once, as
:func:`models.rope.apply_rope` does (in fp16 on XLA:CPU with AVX512-FP16, its 16-bit
form gave "vanilla" a 2.9% gradient error beside "pareprop"'s 0.18%).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SCHEDULES = ("vanilla", "pareprop", "pareprop-stream")
REBUILD_STREAM = 1  # the GPU stream of "pareprop-stream"'s rebuild (0 is the compute stream)


# ----------------------------------------------------------------------------- keys, checks
def layer_keys(key, num_layers: int):
  """Per-layer keys ``(keys_f, keys_g)``, stacked on a leading axis of ``num_layers``.

  ``kf_i = fold_in(fold_in(key, i), 0)``, ``kg_i = fold_in(fold_in(key, i), 1)``. Takes
  typed keys (``jax.random.key``) and raw ``uint32[2]`` keys; ``(None, None)`` for None.
  """
  if key is None:
    return None, None
  if num_layers < 1:
    raise ValueError(f"layer_keys: num_layers must be >= 1, got {num_layers}")
  per_layer = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_layers))
  keys_f = jax.vmap(lambda k: jax.random.fold_in(k, 0))(per_layer)
  keys_g = jax.vmap(lambda k: jax.random.fold_in(k, 1))(per_layer)
  return keys_f, keys_g


def _num_layers(name, params_f, params_g) -> int:
  """The shared leading (layer) axis of every leaf of both parameter trees."""
  sizes = {}
  for tree_name, tree in (("params_f", params_f), ("params_g", params_g)):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      where = tree_name + jax.tree_util.keystr(path)
      if jnp.ndim(leaf) < 1:
        raise ValueError(f"{name}: {where} is a scalar; every leaf needs a leading layer axis")
      sizes[where] = jnp.shape(leaf)[0]
  if not sizes:
    raise ValueError(f"{name}: params_f and params_g have no leaves; cannot tell the depth")
  if len(set(sizes.values())) > 1:
    listing = ", ".join(f"{w}: {n}" for w, n in sizes.items())
    raise ValueError(f"{name}: parameter leaves disagree on the layer axis ({listing})")
  depth = next(iter(sizes.values()))
  if depth < 1:
    raise ValueError(f"{name}: the layer axis has size 0; need at least one layer")
  return depth


def _check_inputs(name, x1, x2):
  if jnp.shape(x1) != jnp.shape(x2):
    raise ValueError(f"{name}: x1 and x2 must have the same shape, got "
                     f"{jnp.shape(x1)} and {jnp.shape(x2)}")
  if jnp.result_type(x1) != jnp.result_type(x2):
    raise ValueError(f"{name}: x1 and x2 must have the same dtype, got "
                     f"{jnp.result_type(x1)} and {jnp.result_type(x2)}")


def _check_stream_precision(x):
  """16-bit streams are refused: rebuilding ``x2 = y2 - g(y1)`` in 16 bits cancels when
  ``|g(y1)| >> |x2|`` (50% gradient error measured on RevViT at depth 12)."""
  dtype = jnp.result_type(x)
  if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4:
    raise TypeError(
        f"reversible_stack: the streams x1, x2 are {jnp.dtype(dtype).name}; rebuilding block "
        "inputs in backward (x2 = y2 - g(y1)) cancels in 16 bits: pass float32 streams (f "
        "and g may compute in 16 bits and return float32)")


def _call(fn, which, p, x, key):
  """``fn(p, x, key)``, checked to return an array shaped and typed like ``x``."""
  out = fn(p, x, key)
  if jnp.shape(out) != jnp.shape(x) or jnp.result_type(out) != jnp.result_type(x):
    raise ValueError(f"{which} must return an array of its input's shape and dtype: got "
                     f"{jnp.result_type(out)}{list(jnp.shape(out))} for "
                     f"{jnp.result_type(x)}{list(jnp.shape(x))}")
  return out


def _at(tree, i):
  """Layer ``i`` of a layer-stacked pytree (None stays None)."""
  return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


# ----------------------------------------------------------------------------- block pieces
def _block_forward(f, g, pf, pg, kf, kg, x1, x2):
  y1 = x1 + _call(f, "f", pf, x2, kf)
  y2 = x2 + _call(g, "g", pg, y1, kg)
  return y1, y2


def _block_inverse(f, g, pf, pg, kf, kg, y1, y2):
  x2 = y2 - _call(g, "g", pg, y1, kg)
  x1 = y1 - _call(f, "f", pf, x2, kf)
  return x1, x2


def _is_float(a) -> bool:
  return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def _vjp(fn, which, p, z, key):
  """``jax.vjp`` of ``fn(p, z, key)`` in ``(p, z)``; only float leaves of ``p`` are differentiated.

  Returns ``(out, pullback)``; ``pullback(dout)`` gives ``(list of float-leaf grads, dz)``.
  Integer leaves (counters) get no gradient here: :func:`_param_cotangent` adds float0.
  """
  leaves, treedef = jax.tree.flatten(p)
  is_float = [_is_float(a) for a in leaves]

  def on_float_leaves(float_leaves, z):
    it = iter(float_leaves)
    full = [next(it) if flt else a for a, flt in zip(leaves, is_float)]
    return _call(fn, which, jax.tree.unflatten(treedef, full), z, key)

  return jax.vjp(on_float_leaves, [a for a, flt in zip(leaves, is_float) if flt], z)


def _param_cotangent(params, float_grads):
  """The cotangent tree of ``params``: ``float_grads`` in float leaves, float0 zeros elsewhere."""
  leaves, treedef = jax.tree.flatten(params)
  it = iter(float_grads)
  out = [next(it) if _is_float(a) else np.zeros(jnp.shape(a), jax.dtypes.float0)
         for a in leaves]
  return jax.tree.unflatten(treedef, out)


def _block_grad(f, g, pf, pg, kf, kg, y1, x2, dy1, dy2):
  """Gradient of one block at input ``x2`` and output ``y1`` (``x1`` is not needed)."""
  _, g_vjp = _vjp(g, "g", pg, y1, kg)
  dpg, dz = g_vjp(dy2)
  dx1 = dy1 + dz
  _, f_vjp = _vjp(f, "f", pf, x2, kf)
  dpf, dzf = f_vjp(dx1)
  dx2 = dy2 + dzf
  return dpf, dpg, dx1, dx2


# ----------------------------------------------------------------------------- the stack
def _forward(f, g, params_f, params_g, x1, x2, key, depth):
  keys_f, keys_g = layer_keys(key, depth)

  def body(carry, i):
    x1, x2 = carry
    return _block_forward(f, g, _at(params_f, i), _at(params_g, i), _at(keys_f, i),
                          _at(keys_g, i), x1, x2), None

  (y1, y2), _ = lax.scan(body, (x1, x2), jnp.arange(depth))
  return y1, y2


def _backward_vanilla(f, g, params_f, params_g, keys_f, keys_g, y1, y2, dy1, dy2, depth):
  """RevViT: the VJP's forward of each block also gives its rebuilt inputs."""

  def body(carry, i):
    y1, y2, dy1, dy2 = carry
    pf, pg, kf, kg = _at(params_f, i), _at(params_g, i), _at(keys_f, i), _at(keys_g, i)
    gy, g_vjp = _vjp(g, "g", pg, y1, kg)
    x2 = y2 - gy
    dpg, dz = g_vjp(dy2)
    dx1 = dy1 + dz
    fx, f_vjp = _vjp(f, "f", pf, x2, kf)
    x1 = y1 - fx
    dpf, dzf = f_vjp(dx1)
    dx2 = dy2 + dzf
    return (x1, x2, dx1, dx2), (dpf, dpg)

  (_, _, dx1, dx2), (dpf, dpg) = lax.scan(body, (y1, y2, dy1, dy2), jnp.arange(depth),
                                          reverse=True)
  return dpf, dpg, dx1, dx2


def _backward_pareprop(f, g, params_f, params_g, keys_f, keys_g, y1, y2, dy1, dy2, depth,
                       stream=None):
  """PaReprop: iteration i = gradient of block i || rebuild of block i-1's inputs.

  The carry holds block i's output ``y1`` and rebuilt inputs ``(x1, x2)``; it leaves
  block i-1's output ``y1`` (= block i's ``x1``) and inputs, rebuilt in this iteration.
  The scan runs all ``L`` iterations so its gradient outputs come out stacked in layer
  order (no params-sized concatenate: measured, that copy grows the compiled temp with
  depth). Iteration 0 has no block -1 to rebuild: its rebuild reuses block 0's index and
  is discarded, one wasted forward of ``f`` and ``g`` per backward pass. ``stream``:
  the GPU stream the in-loop rebuild is annotated to run on (None: no annotation).
  """
  inverse = functools.partial(_block_inverse, f, g)
  if stream is not None:
    inverse = _on_stream(inverse, stream)
  last = depth - 1
  x1, x2 = _block_inverse(f, g, _at(params_f, last), _at(params_g, last),
                          _at(keys_f, last), _at(keys_g, last), y1, y2)  # prologue

  def body(carry, i):
    y1, x1, x2, dy1, dy2 = carry
    # (a) gradient of block i at its already rebuilt inputs.
    dpf, dpg, dx1, dx2 = _block_grad(f, g, _at(params_f, i), _at(params_g, i),
                                     _at(keys_f, i), _at(keys_g, i), y1, x2, dy1, dy2)
    # (b) independent of (a): block i-1's inputs from block i's inputs.
    j = jnp.maximum(i - 1, 0)  # i == 0: rebuilds block 0 again, result unused
    px1, px2 = inverse(_at(params_f, j), _at(params_g, j), _at(keys_f, j), _at(keys_g, j),
                       x1, x2)
    return (x1, px1, px2, dx1, dx2), (dpf, dpg)

  (_, _, _, dx1, dx2), (dpf, dpg) = lax.scan(body, (y1, x1, x2, dy1, dy2),
                                             jnp.arange(depth), reverse=True)
  return dpf, dpg, dx1, dx2


def _on_stream(fn, stream: int):
  """``fn`` as one call under JAX's GPU stream annotation (ignored off the GPU).

  ``fn`` is traced before the annotation is entered, so only the call carries it, not
  every op and nested call inside: traced under ``compute_on``, each of the rebuild's ~180
  inner calls (``jnp.where``, ``jax.nn.gelu``, ...) became its own async call on the
  stream, and XLA:GPU (jaxlib 0.10.2, compiled for an H100) failed with "A cycle is
  detected" on those inside the attention's key-block loop. Replaying the jaxpr restores
  each equation's own context, which has no annotation.
  """
  from jax.extend.core import jaxpr_as_fun

  def call(*args):
    traced, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out = stream_call(jaxpr_as_fun(traced), stream)(*jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)
  return call


def stream_call(fn, stream: int):
  """``fn`` (of arrays, on the device) as one call under JAX's annotation for GPU stream
  ``stream``. JAX's experimental API moved: jax 0.10 has ``compute_on2(f,
  compute_type=, out_memory_spaces=)`` beside the context manager ``compute_on(type)``;
  from 0.11 that decorator is ``compute_on`` itself."""
  from jax.experimental import compute_on as api  # experimental: imported on use
  decorate = getattr(api, "compute_on2", None) or api.compute_on
  return decorate(fn, compute_type=f"gpu_stream:{stream}",
                  out_memory_spaces=jax.memory.Space.Device)


_BACKWARD = {"vanilla": _backward_vanilla, "pareprop": _backward_pareprop,
             "pareprop-stream": functools.partial(_backward_pareprop, stream=REBUILD_STREAM)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _reversible(f, g, schedule, depth, params_f, params_g, x1, x2, key):
  return _forward(f, g, params_f, params_g, x1, x2, key, depth)


def _reversible_fwd(f, g, schedule, depth, params_f, params_g, x1, x2, key):
  y1, y2 = _forward(f, g, params_f, params_g, x1, x2, key, depth)
  return (y1, y2), (y1, y2, params_f, params_g, key)  # nothing per layer


def _reversible_bwd(f, g, schedule, depth, res, cotangents):
  y1, y2, params_f, params_g, key = res
  dy1, dy2 = cotangents
  keys_f, keys_g = layer_keys(key, depth)
  dpf, dpg, dx1, dx2 = _BACKWARD[schedule](f, g, params_f, params_g, keys_f, keys_g,
                                           y1, y2, dy1, dy2, depth)
  dkey = None if key is None else np.zeros(jnp.shape(key), jax.dtypes.float0)
  return (_param_cotangent(params_f, dpf), _param_cotangent(params_g, dpg), dx1, dx2, dkey)


_reversible.defvjp(_reversible_fwd, _reversible_bwd)


def reversible_stack(f, g, params_f, params_g, x1, x2, key=None, *, schedule: str = "vanilla"):
  """Runs ``L`` reversible blocks; backward rebuilds activations instead of saving them.

  ``f(p, x, key)`` and ``g(p, x, key)`` are static callables returning arrays shaped like
  ``x`` (``key`` may be None). Every leaf of ``params_f``/``params_g`` is stacked on a
  leading layer axis of size ``L``; non-float leaves (counters) get float0 cotangents.
  ``key`` (typed or raw) gives block ``i`` the keys of :func:`layer_keys`, replayed in
  backward. Saves for backward only ``(y1, y2)``, the parameters and the key.
  ``schedule``: "vanilla", "pareprop" or "pareprop-stream" (see the module docstring).
  Returns ``(y1, y2)``.
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"reversible_stack: unknown schedule {schedule!r}; valid: "
                     f"{', '.join(SCHEDULES)}")
  _check_inputs("reversible_stack", x1, x2)
  _check_stream_precision(x1)
  depth = _num_layers("reversible_stack", params_f, params_g)
  return _reversible(f, g, schedule, depth, params_f, params_g, x1, x2, key)


def reference_stack(f, g, params_f, params_g, x1, x2, key=None):
  """The same stack under plain autodiff (``lax.scan``, per-layer residuals): the baseline."""
  _check_inputs("reference_stack", x1, x2)
  depth = _num_layers("reference_stack", params_f, params_g)
  return _forward(f, g, params_f, params_g, x1, x2, key, depth)
