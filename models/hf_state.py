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
Each merged linear also keeps the affine (``models.linear.NormAffine``), for what trains
behind the norm (LoRA's adapters).
Tensors stay numpy in the checkpoint's dtype until the model holds them (merges run in
float64); each stacked variable is filled row by row in a device buffer (donated
updates) and assigned once.
"""

from __future__ import annotations

import dataclasses
import math
import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowmem_jax import quantized_weight
from models.embedding import Embed
from models.linear import FrozenKernel


class CheckpointError(ValueError):
  """A checkpoint does not match the model: names the missing/unexpected/mis-shaped keys."""


# dtype names (numpy's, safetensors') of the float tensors a weight may be stored in
_FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16",
                           "F64", "F32", "F16", "BF16"})


def header_of(state: Mapping, key: str) -> tuple[tuple[int, ...], str]:
  """``(shape, dtype name)`` of ``state[key]``: from the file header where ``state`` has
  one (``models.hf.SafetensorsFiles``: no read), else from the array."""
  if hasattr(state, "header"):
    return state.header(key)
  value = state[key]
  return tuple(np.shape(value)), np.asarray(value).dtype.name


class StateReader:
  """Reads a state dict for :func:`read_state`, recording what is missing, unexpected or
  mis-shaped. ``source`` (the checkpoint's path) heads every error."""

  def __init__(self, state: Mapping[str, np.ndarray], *, ignore: Sequence[str] = (),
               source: str = ""):
    self.state = state
    self.ignore = tuple(ignore)  # key substrings that may be present and unused
    self.source = source
    self.used: set[str] = set()
    self.missing: list[str] = []
    self.misshaped: list[str] = []

  def has(self, key: str) -> bool:
    return key in self.state

  def check(self, expected: Mapping[str, Sequence[int] | None]) -> None:
    """Before any tensor is read: raises :class:`CheckpointError` naming every tensor of
    ``expected`` (name -> shape, None for any) that is missing, mis-shaped or not a float
    tensor, and every unexpected one (shapes and dtypes from the file headers)."""
    missing, misshaped, not_float = [], [], []
    for key, shape in expected.items():
      if key not in self.state:
        missing.append(key)
        continue
      have, dtype = header_of(self.state, key)
      if shape is not None and have != tuple(shape):
        misshaped.append(f"{key}: checkpoint {list(have)}, model {list(shape)}")
      if dtype not in _FLOAT_DTYPES:
        not_float.append(f"{key}: {dtype}")
    self._raise(missing, self.unexpected(set(expected)), misshaped, not_float)

  def take(self, key: str, shape: Sequence[int] | None = None) -> np.ndarray:
    """The tensor ``key`` as numpy in the checkpoint's dtype (no float64 copy of it in
    flight: merges upcast themselves); zeros of ``shape`` if it is missing or
    mis-shaped (recorded for :meth:`finish`)."""
    if key not in self.state:
      self.missing.append(key)
      return np.zeros(() if shape is None else tuple(shape))
    value = np.asarray(self.state[key])
    self.used.add(key)
    if shape is not None and tuple(value.shape) != tuple(shape):
      self.misshaped.append(f"{key}: checkpoint {list(value.shape)}, model {list(shape)}")
      return np.zeros(tuple(shape))  # keep going: finish() reports every problem
    return value

  def finish(self) -> None:
    """Raises :class:`CheckpointError` naming every problem found while reading."""
    self._raise(self.missing, self.unexpected(self.used), self.misshaped, [])

  def unexpected(self, used) -> list[str]:
    """The checkpoint's keys not in ``used`` and not ignored."""
    return sorted(k for k in self.state if k not in used
                  and not any(s in k for s in self.ignore))

  def _raise(self, missing, unexpected, misshaped, not_float) -> None:
    problems = []
    if missing:
      problems.append(f"missing keys ({len(missing)}): {', '.join(missing[:20])}")
    if unexpected:
      problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:20])}")
    if misshaped:
      problems.append(f"mis-shaped keys ({len(misshaped)}): " + "; ".join(misshaped[:20]))
    if not_float:
      problems.append(f"keys not of a float dtype ({len(not_float)}): "
                      + "; ".join(not_float[:20]))
    if problems:
      head = f"{self.source}: " if self.source else ""
      raise CheckpointError(f"{head}checkpoint does not match the model: "
                            + " | ".join(problems))


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


@functools.partial(jax.jit, donate_argnums=0)
def _put_row(buffer, row, layer):
  """``buffer`` (a pytree of stacked arrays) with row ``layer`` replaced by ``row``: in
  place (the buffer is donated), one compile per structure."""
  return jax.tree.map(lambda b, r: jax.lax.dynamic_update_index_in_dim(b, r, layer, 0),
                      buffer, row)


class _Rows:
  """The variables being written, each filled row by row in a device buffer (donated
  row updates: no host copy of it) and assigned as soon as all its rows are. A weight
  stored in a base dtype is kept in that form, each row quantized as it is read. Host
  memory holds one tensor in flight; the device the model as it is built."""

  def __init__(self):
    # id(var) -> (var, buffer or None once assigned, rows written, assign(buffer))
    self.arrays: dict[int, tuple] = {}

  def set(self, var: nnx.Variable, layer: int | None, value) -> None:
    current = _value(var)
    shape, dtype = tuple(current.shape), current.dtype
    row = jnp.asarray(np.asarray(value, np.float32).reshape(
        shape if layer is None else shape[1:]), dtype)

    def make():  # a real model (a fresh head's) keeps the rows nothing overwrites
      return jnp.zeros(shape, dtype) if _abstract(current) else jnp.array(current)
    self._write(var, layer, row, make, var.set_value)

  def set_stored(self, module, name: str, layer: int | None, value, format: str,
                 n_in: int, n_out: int, *, source: str) -> None:
    """Row ``layer`` of ``module``'s weight ``name`` (a kernel ``[in..., out...]``, or a
    table ``[V, D]`` with ``n_out=0``) stored in ``format``; ``source`` (the checkpoint's
    tensor) names it in an error."""
    var = getattr(module, name)
    shape = tuple(_value(var).shape)
    try:
      row = quantized_weight.quantize(
          np.asarray(value, np.float32).reshape(shape if layer is None else shape[1:]),
          format, n_in=n_in, n_out=n_out)
    except ValueError as e:  # inf or NaN weights
      raise CheckpointError(f"{source}: {e} (base_dtype)") from None

    def make():
      return jax.tree.map(lambda x: jnp.zeros(shape[:1] + x.shape, x.dtype), row)
    self._write(var, layer, row, make,
                lambda stored: setattr(module, name, FrozenKernel(stored)))

  def _write(self, var, layer, row, make, assign) -> None:
    rows = 1 if layer is None else _value(var).shape[0]
    entry = self.arrays.get(id(var))
    buffer, written = (row, set()) if layer is None else (
        (make(), set()) if entry is None else entry[1:3])
    if layer is not None:
      buffer = _put_row(buffer, row, layer)
    written.add(layer)
    done = len(written) == rows
    if done:
      assign(buffer)
    self.arrays[id(var)] = (var, None if done else buffer, written, assign)

  def get(self, var: nnx.Variable, layer: int | None) -> np.ndarray:
    entry = self.arrays.get(id(var))
    value = entry[1] if entry is not None and entry[1] is not None else _value(var)
    if layer is not None:
      value = jax.tree.map(lambda x: x[layer], value)
    return np.asarray(_host(value), np.float64)

  def assign(self) -> None:
    """Writes the variables with rows still missing (the reader has reported them)."""
    for _, buffer, _, assign in self.arrays.values():
      if buffer is not None:
        assign(buffer)


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
  return shape, module.kernel_axes()[0]


def _hf_shape(e: Tensor, ours: tuple) -> tuple:
  """The HF shape of a Tensor entry whose variable row has shape ``ours`` (``to_hf``
  applied to a zero-stride view: no array of that size is made)."""
  if e.to_hf is None:
    return ours
  return tuple(e.to_hf(np.broadcast_to(np.zeros((), np.float32), ours)).shape)


def expected_tensors(model, entries: Sequence[Entry]) -> dict[str, tuple | None]:
  """Every HF tensor :func:`read_state` reads for ``entries`` and the shape it must have
  (a tied copy: its original's), from ``model``'s (possibly abstract) variables: for
  :meth:`StateReader.check` before any tensor is read."""
  out: dict[str, tuple | None] = {}
  copies = {}
  for e in entries:
    if isinstance(e, Norm):
      d = _resolve(model, e.path).dim
      out[f"{e.hf}.weight"] = (d,)
      if e.bias:
        out[f"{e.hf}.bias"] = (d,)
    elif isinstance(e, Tensor) and e.copy_of is not None:
      copies[e.hf] = e.copy_of
    elif isinstance(e, Tensor):
      ours = tuple(_value(_resolve(model, e.path)).shape)[0 if e.layer is None else 1:]
      out[e.hf] = _hf_shape(e, ours)
    elif isinstance(e, Linear) and not e.keep_weights:
      module = _resolve(model, e.path)
      shape, n_in = _kernel_dims(module, e.layer)
      d_in, d_out = int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))
      out[f"{e.hf}.weight"] = (d_out, d_in)
      if getattr(module, "bias", None) is not None:
        out[f"{e.hf}.bias"] = (d_out,)
  for copy, original in copies.items():
    out.setdefault(copy, out.get(original))
  return out


def _format(store, path: str, module) -> str:
  """``store``'s storage name for ``module``'s weight ("float32" without a store)."""
  return "float32" if store is None else (store(tuple(path.split(".")), module)
                                          or "float32")


def _stored_weights(model, entries: Sequence[Entry]):
  """``(path, module)`` of each weight of the map a ``store`` may name a storage for: a
  linear's kernel, an embedding's table."""
  for e in entries:
    if isinstance(e, Linear) and not e.keep_weights:
      yield e.path, _resolve(model, e.path)
    elif isinstance(e, Tensor) and e.copy_of is None and e.path.endswith(".embedding"):
      owner = e.path.rpartition(".")[0]
      if isinstance(_resolve(model, owner), Embed):
        yield owner, _resolve(model, owner)


def check_store(model, entries: Sequence[Entry], store: Callable | None) -> None:
  """Every storage ``store`` names for the map's weights is one of
  ``quantized_weight.FORMATS``: a ValueError naming the weight otherwise,
  before any tensor is read."""
  for path, module in _stored_weights(model, entries) if store is not None else ():
    if (format := _format(store, path, module)) not in quantized_weight.FORMATS:
      raise ValueError(f"store: {format!r} (for {path}) is not a storage; valid: "
                       f"{', '.join(quantized_weight.FORMATS)}")


def read_state(model, entries: Sequence[Entry], reader: StateReader, *,
               store: Callable | None = None) -> None:
  """Loads every entry of the map from ``reader`` into ``model`` (in place; ``model`` may
  be abstract, from ``nnx.eval_shape``). Norms come first, so the linears reading a
  merged norm find its affine. ``store(path, module)``: the storage of that module's
  frozen weight, a linear's kernel or an embedding's table
  (``lowmem_jax.quantized_weight.FORMATS``; None or "float32": as it is), each row
  quantized as it is read."""
  from lowmem_jax.norms import merge_norm_affine

  rows, affines = _Rows(), {}
  for e in entries:  # tied copies first: a copy that differs is found before any weight
    if isinstance(e, Tensor) and e.copy_of is not None and not np.array_equal(
        reader.take(e.hf), reader.take(e.copy_of)):
      head = f"{reader.source}: " if reader.source else ""
      raise CheckpointError(f"{head}{e.hf} differs from {e.copy_of} but the config ties "
                            "them (tie_word_embeddings)")
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
      continue  # compared above
    elif isinstance(e, Tensor):
      var = _resolve(model, e.path)
      ours = tuple(_value(var).shape)[0 if e.layer is None else 1:]
      value = reader.take(e.hf, _hf_shape(e, ours))
      value = value if e.to_ours is None else e.to_ours(value)
      owner, name = e.path.rpartition(".")[::2]
      module = _resolve(model, owner) if owner else model
      format = (_format(store, owner, module)
                if isinstance(module, Embed) and name == "embedding" else "float32")
      if format == "float32":
        rows.set(var, e.layer, value)
      else:
        rows.set_stored(module, name, e.layer, value, format, n_in=1, n_out=0,
                        source=_named(reader, e.hf))
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
        kernel, bias = merge_norm_affine(*affines[e.norm],
                                         kernel.astype(np.float32, copy=False), bias)
        if bias is not None and not has_bias:
          raise CheckpointError(f"{e.hf}: merging the norm bias needs a bias on this linear")
        if module.norm_scale is None:  # the model and its map disagree
          raise ValueError(f"{e.path}: the map merges {e.norm} into it, but the linear was "
                           "not built with reads_norm=True (it keeps no NormAffine)")
      _set_norm_affine(rows, module, e.layer, affines.get(e.norm))
      format = _format(store, e.path, module)
      if format == "float32":
        rows.set(module.kernel, e.layer, kernel)
      else:
        rows.set_stored(module, "kernel", e.layer, kernel, format, n_in,
                        len(shape) - n_in, source=_named(reader, f"{e.hf}.weight"))
      if has_bias:
        rows.set(module.bias, e.layer, bias)
  rows.assign()


def _named(reader: StateReader, tensor: str) -> str:
  """``tensor`` as an error names it: with the checkpoint it is read from."""
  return f"{reader.source}: {tensor}" if reader.source else tensor


def _set_norm_affine(rows: _Rows, module, layer: int | None, affine) -> None:
  """Row ``layer`` of the merged norm's affine a linear keeps (``models.linear.NormAffine``):
  ``affine`` (scale, shift or None), or the identity where no norm is merged into it."""
  if module.norm_scale is None:
    return
  d = tuple(_value(module.norm_scale).shape)[0 if layer is None else 1:]
  scale, shift = affine if affine is not None else (np.ones(d), None)
  rows.set(module.norm_scale, layer, scale)
  if module.norm_shift is not None:
    rows.set(module.norm_shift, layer, np.zeros(d) if shift is None else shift)


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


# ---------------------------------------------------------------- a merged LoRA export
# safetensors/numpy dtype names -> the numpy dtype a tensor of that name is written in
_NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
                 "BF16": jnp.bfloat16, "float64": np.float64, "float32": np.float32,
                 "float16": np.float16, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class OutTensor:
  """A tensor an export writes: its HF name, shape and dtype, and ``make()``, which
  gives its value when its file is written (nothing is held before)."""
  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  make: Callable[[], np.ndarray]

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _key(e: Entry) -> tuple:
  return type(e).__name__, e.path, e.layer


def merged_tensors(model, entries: Sequence[Entry], base: Mapping[str, np.ndarray],
                   base_entries: Sequence[Entry], trained: Callable[[nnx.Variable], bool]
                   ) -> list[OutTensor]:
  """The HF tensors of ``entries`` (the export's map) as peft's ``merge_and_unload`` writes
  a LoRA run: each one the run trained (``trained(variable)``) or ``base`` lacks (a fresh
  head) from ``model``, every other one ``base``'s (the pretrained checkpoint, by
  ``base_entries``, the map it was loaded with), an adapted linear's weight with its
  adapter's ``scale * A @ B`` added (:meth:`models.lora.LoRALinear.checkpoint_delta`, the
  sum in float32, or float64 for a float64 tensor, then rounded once). Each in ``base``'s
  dtype (float32 where ``base`` lacks it); nothing read before its ``make()``. What comes
  from ``model`` must be in the checkpoint's parametrization: LoRA's adapters and the
  linears it trains in full are, under every policy (:mod:`models.lora`); a fresh head
  held merged with an MS norm is un-merged here. A CheckpointError names each tensor of
  ``base`` that is missing or has another shape than the model's (the checkpoint changed
  since the run read it; changed values are not detected)."""
  from models.lora import LoRALinear
  read = {_key(e): e for e in base_entries}
  out: list[OutTensor] = []
  problems = []

  def add(name, base_name, shape, ours, from_model, delta=None):
    """``name`` (HF ``shape``): ``ours()`` from the model, or ``base[base_name]`` plus
    ``delta()`` where given; in ``base``'s dtype where it has the tensor."""
    if base_name is not None and base_name not in base:
      if not from_model:
        problems.append(f"{base_name}: missing")
        return
      base_name = None
    dtype = np.dtype(np.float32)
    if base_name is not None:
      have, dtype = header_of(base, base_name)
      if tuple(have) != shape:
        problems.append(f"{base_name}: checkpoint {list(have)}, model {list(shape)}")
        return
      dtype = np.dtype(_NUMPY_DTYPES[dtype])
    if from_model:
      out.append(OutTensor(name, shape, dtype,
                           lambda: np.asarray(ours(), np.float32).reshape(shape).astype(dtype)))
      return
    work = np.promote_types(dtype, np.float32)  # the sum's dtype: f32, or f64 for an f64 one

    def make():
      value = base[base_name]
      if delta is not None:
        value = np.asarray(value, work) + delta()
      return np.asarray(value).astype(dtype, copy=False)
    out.append(OutTensor(name, shape, dtype, make))

  for e in entries:
    r = read.get(_key(e))
    if isinstance(e, Tensor) and e.copy_of is not None:
      continue  # a tied copy: not written (as write_state)
    if isinstance(e, Norm):
      norm = _resolve(model, e.path)
      mine = norm.scale is not None and trained(norm.scale)
      for w in ("weight", "bias") if e.bias else ("weight",):
        var = norm.scale if w == "weight" else norm.bias
        add(f"{e.hf}.{w}", None if r is None else f"{r.hf}.{w}", (norm.dim,),
            lambda var=var, e=e: _row(np.asarray(var[...]), e.layer), mine)
    elif isinstance(e, Tensor):
      var = _resolve(model, e.path)

      def ours(var=var, e=e):
        value = _row(_host(_value(var)), e.layer)
        return value if e.to_hf is None else e.to_hf(value)
      shape = _hf_shape(e, tuple(_value(var).shape)[0 if e.layer is None else 1:])
      add(e.hf, None if r is None else r.hf, shape, ours, trained(var))
    elif isinstance(e, Linear):
      module = _resolve(model, e.path)
      lora = module if isinstance(module, LoRALinear) else None
      linear = module if lora is None else lora.base
      mine = trained(linear.kernel) or r is None or r.keep_weights
      if mine and linear.norm_scale is not None and not linear.affine_at_call:
        linear = nnx.clone(linear)  # a fresh head merged with the norm (MS) and not
        linear.unmerge_norm_affine()  # trained: the checkpoint's parametrization
      shape, n_in = _kernel_dims(linear, e.layer)
      d_in, d_out = int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))
      delta = None if lora is None else (
          lambda lora=lora, e=e: lora.checkpoint_delta(e.layer).T)

      def kernel(linear=linear, e=e, d_in=d_in, delta=delta):
        w = _row(_host(_value(linear.kernel)), e.layer).reshape(d_in, -1).T
        return w if delta is None else w + delta()
      add(f"{e.hf}.weight", None if r is None else f"{r.hf}.weight", (d_out, d_in), kernel,
          mine, delta)
      if getattr(linear, "bias", None) is not None:
        add(f"{e.hf}.bias", None if r is None else f"{r.hf}.bias", (d_out,),
            lambda linear=linear, e=e: _row(np.asarray(linear.bias[...]), e.layer),
            mine or trained(linear.bias))
  if problems:
    raise CheckpointError("the checkpoint does not match the run's model (it changed since "
                          f"the run read it?): {'; '.join(problems[:20])}")
  return out
