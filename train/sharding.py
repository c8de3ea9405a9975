"""Scaling past one device with JAX's own sharding: a mesh with data and FSDP axes.

``--mesh data=8`` replicates parameters and splits the batch 8 ways; ``data=2,fsdp=4``
also splits each parameter (and its optimizer state) along its largest axis divisible
by 4, never the layer axis of stacked blocks (everything under a model's ``stack``,
:mod:`models.stack`: the scan takes one layer per step). The batch is split over both
axes. Multi-host: ``jax.distributed.initialize()``.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp")


def mesh_sizes(spec: str) -> dict[str, int]:
  """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4}`` (an axis not named: 1); a
  ValueError for anything else. Needs no device: the config checks it."""
  sizes = {"data": 1, "fsdp": 1}
  for part in spec.split(","):
    name, sep, value = part.partition("=")
    if not sep or name.strip() not in sizes or not value.strip().isdigit():
      raise ValueError(f"mesh={spec!r}: expected comma-separated data=N and/or fsdp=M")
    if int(value) < 1:
      raise ValueError(f"mesh={spec!r}: {name.strip()}={int(value)}; axis sizes must be >= 1")
    sizes[name.strip()] = int(value)
  return sizes


def make_mesh(spec: str) -> Mesh | None:
  """``"data=2,fsdp=4"`` -> a 2x4 Mesh over the first 8 devices; ``""`` -> None (one
  device; a ValueError on a multi-host run, whose hosts would each train alone)."""
  if not spec:
    if jax.process_count() > 1:
      raise ValueError(f"a run over {jax.process_count()} hosts needs a mesh over their "
                       f"{jax.device_count()} devices (mesh=data={jax.device_count()}, or "
                       "data=N,fsdp=M with N*M of them); without one each host trains alone")
    return None
  sizes = mesh_sizes(spec)
  need = math.prod(sizes.values())
  devices = jax.devices()
  if need > len(devices):
    raise ValueError(f"mesh={spec!r} needs {need} devices; {len(devices)} available")
  if jax.process_count() > 1 and need != len(devices):  # a host outside it would hang
    raise ValueError(f"mesh={spec!r} uses {need} of the {len(devices)} devices of "
                     f"{jax.process_count()} hosts; a multi-host mesh must use all of them")
  return Mesh(np.asarray(devices[:need]).reshape(sizes["data"], sizes["fsdp"]), AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (example) axis split over every mesh axis."""
  return NamedSharding(mesh, P(AXES))


def param_sharding(mesh: Mesh, shape, *, stacked: bool = False) -> NamedSharding:
  """FSDP: the largest axis divisible by the fsdp size is split (not the leading layer
  axis of a ``stacked`` variable); otherwise replicated."""
  n = mesh.shape["fsdp"]
  spec = [None] * len(shape)
  if n > 1:
    first = 1 if stacked else 0
    for axis in sorted(range(first, len(shape)), key=lambda a: -shape[a]):
      if shape[axis] % n == 0:
        spec[axis] = "fsdp"
        break
  while spec and spec[-1] is None:  # P("fsdp") not P("fsdp", None): the spec a step's
    spec.pop()                      # outputs get, so the next step's inputs match it
  return NamedSharding(mesh, P(*spec))


def _is_stacked(path) -> bool:
  return any(getattr(k, "key", getattr(k, "name", None)) == "stack" for k in path)


def state_shardings(state, mesh: Mesh):
  """Each leaf's place on ``mesh`` (:func:`param_sharding`), from its path and shape alone:
  the same for arrays, ShapeDtypeStructs and a traced step's values (which the train step
  pins its new state to, so a state leaf written from the batch, such as WTA-CRS's example
  ids, keeps its place and the next step runs the same executable)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: param_sharding(mesh, np.shape(x), stacked=_is_stacked(path)), state)


def shard_state(state, mesh: Mesh):
  return jax.tree.map(_global_array, state, state_shardings(state, mesh))


def _global_array(x, sharding: NamedSharding):
  """``x`` (the same on every host) placed by ``sharding``: each host puts its own
  devices' pieces (``jax.device_put`` of host values over several hosts would first
  gather every host's copy to check they agree: the whole batch across hosts, every
  step)."""
  if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
    return jax.device_put(x, sharding)  # (a global array already: moved, not gathered)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def micro_batches(batch: dict, grad_accum: int, mesh: Mesh | None) -> dict:
  """``batch`` as ``[grad_accum, batch / grad_accum, ...]``: micro-batch ``i`` holds
  examples ``i, i + grad_accum, ...``. On a mesh each device's rows of the batch then split
  evenly over the micro-batches, so each micro-batch stays split over every device with no
  communication (consecutive micro-batches would each live on a few devices, and the scan
  would gather each one everywhere)."""
  def split(x):
    x = x.reshape((-1, grad_accum) + x.shape[1:]).swapaxes(0, 1)
    if mesh is None:
      return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, AXES)))
  return {k: split(v) for k, v in batch.items()}


def shard_batch(batch: dict, mesh: Mesh) -> dict:
  sharding = batch_sharding(mesh)
  size = math.prod(mesh.shape.values())
  for k, v in batch.items():
    if v.shape[0] % size:
      raise ValueError(f"batch field {k!r} has {v.shape[0]} examples, not divisible by the "
                       f"{size} devices of the mesh")
  return {k: _global_array(v, sharding) for k, v in batch.items()}
