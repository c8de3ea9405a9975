"""Hugging Face state dicts (name -> numpy array) <-> our models, by a declared key map.

A model module declares ``hf_map(cfg, keys)``: a list of :class:`Tensor`,
:class:`Linear` and :class:`Norm` entries, each an HF name and the path of our
variable or module (``"stack.blocks.attn.query"``) with, for stacked blocks, the
``layer`` row. One generic pair applies any map: :func:`read_state` (through a
:class:`StateReader`, which checks shapes and remembers what was used, so
``reader.finish()`` names every missing, unexpected or mis-shaped key at once) and
:func:`write_state`.

MS norms: a :class:`Norm` whose module holds no affine (the policy merges it) has its
HF affine folded into every :class:`Linear` that names it as ``norm``
(``lowmem_jax.norms.merge_norm_affine``, float64). Exported, such a norm is weight 1 /
bias 0 with the merged linears, unless the entry names where the affine is ``kept``
(BERT's residual path): then that affine is exported and the linears un-merged with it.
Tensors stay in float64 numpy until the model holds them; each stacked variable is
filled row by row in numpy and assigned once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowmem_jax import quantized_weight
from models.linear import FrozenKernel


class CheckpointError(ValueError):
  """A checkpoint does not match the model: names the missing/unexpected/mis-shaped keys."""


class StateReader:

  def __init__(self, state: Mapping[str, np.ndarray], *, ignore: Sequence[str] = ()):
    self.state = state
    self.ignore = tuple(ignore)  # key substrings that may be present and unused
    self.used: set[str] = set()
    self.missing: list[str] = []
    self.misshaped: list[str] = []

  def has(self, key: str) -> bool:
    return key in self.state

  def take(self, key: str, shape: Sequence[int] | None = None) -> np.ndarray:
    """The tensor ``key`` as float64 numpy; zeros of ``shape`` if it is missing or
    mis-shaped (recorded for :meth:`finish`)."""
    if key not in self.state:
      self.missing.append(key)
      return np.zeros(() if shape is None else tuple(shape))
    value = np.asarray(self.state[key])
    self.used.add(key)
    if shape is not None and tuple(value.shape) != tuple(shape):
      self.misshaped.append(f"{key}: checkpoint {list(value.shape)}, model {list(shape)}")
      return np.zeros(tuple(shape))  # keep going: finish() reports every problem
    return value.astype(np.float64) if np.issubdtype(value.dtype, np.floating) else value

  def finish(self) -> None:
    """Raises :class:`CheckpointError` naming every problem found while reading."""
    unexpected = sorted(k for k in self.state if k not in self.used
                        and not any(s in k for s in self.ignore))
    problems = []
    if self.missing:
      problems.append(f"missing keys ({len(self.missing)}): {', '.join(self.missing[:20])}")
    if unexpected:
      problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:20])}")
    if self.misshaped:
      problems.append(f"mis-shaped keys ({len(self.misshaped)}): "
                      + "; ".join(self.misshaped[:20]))
    if problems:
      raise CheckpointError("checkpoint does not match the model: " + " | ".join(problems))


# ----------------------------------------------------------------------------- the map
@dataclasses.dataclass(frozen=True)
class Tensor:
  """HF tensor ``hf`` <-> our variable at ``path`` (row ``layer`` if stacked);
  ``to_ours``/``to_hf`` change layout (e.g. a conv kernel's axes). ``copy_of``: the HF
  tensor is a tied copy of that one (read only to check that it is equal; not written)."""
  hf: str
  path: str
  layer: int | None = None
  to_ours: Callable[[np.ndarray], np.ndarray] | None = None
  to_hf: Callable[[np.ndarray], np.ndarray] | None = None
  copy_of: str | None = None


@dataclasses.dataclass(frozen=True)
class Linear:
  """HF ``{hf}.weight`` (torch ``[out, in]``) and ``.bias`` <-> the ``nnx.Linear`` /
  ``LinearGeneral`` at ``path`` (kernel ``[in..., out...]``). ``norm``: the HF prefix of
  the norm whose output it reads (merged into it when that norm is). ``keep_weights``:
  the checkpoint has none (a fresh head); only the norm is merged into the model's own."""
  hf: str
  path: str
  layer: int | None = None
  norm: str | None = None
  keep_weights: bool = False


@dataclasses.dataclass(frozen=True)
class Norm:
  """HF ``{hf}.weight`` (and ``.bias`` if ``bias``) <-> the norm module at ``path``.
  When the norm is merged, ``kept`` names variables that keep its affine anyway:
  ``(scale path, bias path or None)``."""
  hf: str
  path: str
  layer: int | None = None
  bias: bool = True
  kept: tuple[str, str | None] | None = None


Entry = Tensor | Linear | Norm


def _resolve(model, path: str):
  node = model
  for part in path.split("."):
    node = getattr(node, part)
  return node


def _row(value, layer):
  return value if layer is None else value[layer]


def _value(var: nnx.Variable):
  return var.get_value()


def _abstract(value) -> bool:
  return isinstance(value, jax.ShapeDtypeStruct)


def _host(value) -> np.ndarray:
  """A variable's value as numpy (fp32); a stored frozen kernel dequantized."""
  if isinstance(value, quantized_weight.QuantizedKernel):
    value = quantized_weight.dequantize(value)
  return np.asarray(value, np.float32)


_quantize = jax.jit(quantized_weight.quantize, static_argnames=("format", "n_in", "n_out",
                                                             "double_quant"))


class _Rows:
  """Numpy copies of the variables being written, each assigned as soon as all its rows
  are (so host memory holds about one stacked variable beyond the model). A kernel
  stored in a base dtype is kept in that form, one row quantized as it is read."""

  def __init__(self):
    self.arrays: dict[int, tuple[nnx.Variable, object, set]] = {}

  def _buffer(self, var, make):
    if id(var) not in self.arrays:
      self.arrays[id(var)] = (var, make(), set())
    return self.arrays[id(var)][1]

  def set(self, var: nnx.Variable, layer: int | None, value) -> None:
    def make():
      current = _value(var)
      if _abstract(current):
        return np.zeros(current.shape, np.float32)
      return np.array(current, np.float32)
    array = self._buffer(var, make)
    target = array if layer is None else array[layer]
    target[...] = np.asarray(value, np.float32).reshape(target.shape)
    self._done(var, layer, lambda a: jnp.asarray(a, _value(var).dtype))

  def set_stored(self, module, layer: int | None, kernel, format: str, n_in: int) -> None:
    """Row ``layer`` of ``module``'s kernel (``[in..., out...]``) stored in ``format``."""
    var = module.kernel
    shape = tuple(_value(var).shape)
    row_shape = shape if layer is None else shape[1:]
    row = _quantize(np.asarray(kernel, np.float32).reshape(row_shape), format, n_in=n_in,
                    n_out=len(row_shape) - n_in)
    leaves, treedef = jax.tree.flatten(row)
    stack = () if layer is None else (shape[0],)
    buffers = self._buffer(var, lambda: (treedef, [np.zeros(stack + x.shape, x.dtype)
                                                   for x in leaves]))[1]
    for buffer, leaf in zip(buffers, leaves):
      (buffer if layer is None else buffer[layer])[...] = np.asarray(leaf)

    def assign(_):
      module.kernel = FrozenKernel(jax.tree.unflatten(treedef,
                                                      [jnp.asarray(b) for b in buffers]))
    self._done(var, layer, assign, value=False)

  def _done(self, var, layer, assign, value=True) -> None:
    _, array, layers = self.arrays[id(var)]
    layers.add(layer)
    rows = 1 if layer is None else _value(var).shape[0]
    if len(layers) == rows:
      if value:
        var.set_value(assign(array))
      else:
        assign(array)
      self.arrays[id(var)] = (var, None, layers)  # written: read back from the variable

  def get(self, var: nnx.Variable, layer: int | None) -> np.ndarray:
    entry = self.arrays.get(id(var))
    array = entry[1] if entry is not None and entry[1] is not None else _host(_value(var))
    return np.asarray(_row(array, layer), np.float64)

  def assign(self) -> None:
    """Writes the variables with rows still missing (the reader has reported them)."""
    for var, array, _ in self.arrays.values():
      if array is not None and not isinstance(array, tuple):
        var.set_value(jnp.asarray(array, _value(var).dtype))


def init_unread(model, build) -> None:
  """Gives the variables of an abstract ``model`` (``nnx.eval_shape``) that nothing
  filled their initial values: ``build()`` jitted, returning only those (XLA drops the
  initialisation of the rest, so no full-size model is made)."""
  unread = {path: var for path, var in nnx.iter_graph(model)
            if isinstance(var, nnx.Variable) and _abstract(_value(var))}
  if not unread:
    return
  paths = tuple(unread)

  def values():
    built = {p: v for p, v in nnx.iter_graph(build()) if isinstance(v, nnx.Variable)}
    return [_value(built[p]) for p in paths]

  for path, value in zip(paths, jax.jit(values)()):
    unread[path].set_value(value)


def _kernel_dims(module, layer) -> tuple[tuple[int, ...], int]:
  """(kernel shape of one layer, number of input axes)."""
  shape = tuple(_value(module.kernel).shape)[0 if layer is None else 1:]
  axis = getattr(module, "axis", (-1,))
  return shape, len(axis) if isinstance(axis, tuple) else 1


def read_state(model, entries: Sequence[Entry], reader: StateReader, *,
               store: Callable | None = None) -> None:
  """Loads every entry of the map from ``reader`` into ``model`` (in place; ``model`` may
  be abstract, from ``nnx.eval_shape``). Norms come first, so the linears reading a
  merged norm find its affine. ``store(path, linear)``: the format of that linear's
  kernel (``lowmem_jax.quantized_weight.FORMATS``; None or "float32": as it is), each
  row quantized as it is read."""
  from lowmem_jax.norms import merge_norm_affine

  rows, affines = _Rows(), {}
  for e in (e for e in entries if isinstance(e, Norm)):
    norm = _resolve(model, e.path)
    d = norm.dim
    scale = reader.take(f"{e.hf}.weight", (d,))
    bias = reader.take(f"{e.hf}.bias", (d,)) if e.bias else None
    if norm.scale is not None:
      rows.set(norm.scale, e.layer, scale)
      if bias is not None:
        rows.set(norm.bias, e.layer, bias)
      continue
    affines[e.hf] = (scale, bias)
    if e.kept is not None:
      rows.set(_resolve(model, e.kept[0]), e.layer, scale)
      if e.kept[1] is not None:
        rows.set(_resolve(model, e.kept[1]), e.layer, bias)
  for e in entries:
    if isinstance(e, Tensor) and e.copy_of is not None:
      if not np.array_equal(reader.take(e.hf), reader.take(e.copy_of)):
        raise CheckpointError(f"{e.hf} differs from {e.copy_of} but the config ties them")
    elif isinstance(e, Tensor):
      var = _resolve(model, e.path)
      ours = tuple(_value(var).shape)[0 if e.layer is None else 1:]
      hf_shape = ours if e.to_hf is None else e.to_hf(np.zeros(ours)).shape
      value = reader.take(e.hf, hf_shape)
      rows.set(var, e.layer, value if e.to_ours is None else e.to_ours(value))
    elif isinstance(e, Linear):
      module = _resolve(model, e.path)
      shape, n_in = _kernel_dims(module, e.layer)
      d_in, d_out = int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))
      has_bias = getattr(module, "bias", None) is not None
      if e.keep_weights:
        kernel = rows.get(module.kernel, e.layer).reshape(d_in, d_out)
        bias = rows.get(module.bias, e.layer).reshape(d_out) if has_bias else None
      else:
        kernel = reader.take(f"{e.hf}.weight", (d_out, d_in)).T
        bias = reader.take(f"{e.hf}.bias", (d_out,)) if has_bias else None
      if e.norm in affines:
        kernel, bias = merge_norm_affine(*affines[e.norm], kernel.astype(np.float32), bias)
        if bias is not None and not has_bias:
          raise CheckpointError(f"{e.hf}: merging the norm bias needs a bias on this linear")
      format = "float32" if store is None else (store(tuple(e.path.split(".")), module)
                                                  or "float32")
      if format == "float32":
        rows.set(module.kernel, e.layer, kernel)
      else:
        rows.set_stored(module, e.layer, kernel, format, n_in)
      if has_bias:
        rows.set(module.bias, e.layer, bias)
  rows.assign()


def write_state(model, entries: Sequence[Entry]) -> dict[str, np.ndarray]:
  """HF tensors (torch layout, float32) of ``model`` by the map: the inverse of
  :func:`read_state`. A merged norm with a ``kept`` affine is exported as that affine
  and each linear reading it un-merged with it."""
  state: dict[str, np.ndarray] = {}
  unmerge = {}
  for e in (e for e in entries if isinstance(e, Norm)):
    norm = _resolve(model, e.path)
    if norm.scale is not None:
      scale = _row(np.asarray(norm.scale[...]), e.layer)
      bias = _row(np.asarray(norm.bias[...]), e.layer) if e.bias else None
    elif e.kept is not None:
      scale = _row(np.asarray(_resolve(model, e.kept[0])[...]), e.layer)
      bias = (None if e.kept[1] is None
              else _row(np.asarray(_resolve(model, e.kept[1])[...]), e.layer))
      unmerge[e.hf] = (scale, bias)
    else:  # merged into its readers: an identity affine computes the same function
      scale, bias = np.ones(norm.dim), np.zeros(norm.dim) if e.bias else None
    state[f"{e.hf}.weight"] = np.asarray(scale, np.float32)
    if e.bias:
      state[f"{e.hf}.bias"] = np.asarray(bias, np.float32)
  for e in entries:
    if isinstance(e, Tensor) and e.copy_of is None:
      value = _row(_host(_value(_resolve(model, e.path))), e.layer)
      state[e.hf] = value if e.to_hf is None else e.to_hf(value)
    elif isinstance(e, Linear):
      module = _resolve(model, e.path)
      shape, n_in = _kernel_dims(module, e.layer)
      kernel = _row(_host(_value(module.kernel)), e.layer)
      state[f"{e.hf}.weight"] = kernel.reshape(int(np.prod(shape[:n_in])), -1).T
      if getattr(module, "bias", None) is not None:
        state[f"{e.hf}.bias"] = _row(np.asarray(module.bias[...], np.float32),
                                     e.layer).reshape(-1)
      if e.norm in unmerge:
        _unmerge(state, e.hf, *unmerge[e.norm])
  return {k: np.ascontiguousarray(v, np.float32) for k, v in state.items()}


def _unmerge(state: dict, prefix: str, gamma, beta) -> None:
  """Inverse of the merge on a torch-layout linear in ``state``: ``W = W' / gamma``
  (per input), ``b = b' - W @ beta``, in float64."""
  gamma = np.asarray(gamma, np.float64)
  if np.any(gamma == 0):
    raise ValueError(f"write_state: {prefix} reads a norm with gamma == 0 in "
                     f"{int(np.sum(gamma == 0))} channel(s); its merged weights cannot be "
                     "un-merged")
  w = np.asarray(state[f"{prefix}.weight"], np.float64) / gamma[None, :]
  state[f"{prefix}.weight"] = w.astype(np.float32)
  if beta is not None:
    b = np.asarray(state[f"{prefix}.bias"], np.float64) - w @ np.asarray(beta, np.float64)
    state[f"{prefix}.bias"] = b.astype(np.float32)
