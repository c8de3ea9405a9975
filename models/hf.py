"""Hugging Face checkpoints: ``load_pretrained``, ``save_pretrained`` and
``save_lora_merged``.

A model directory holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). ``model_type`` picks the family in
:mod:`models.registry` (``vit``, ``llama``, ``bert``/``roberta``); its module declares
the map from HF names to our variables (``hf_map``), which one generic reader/writer
(:mod:`models.hf_state`) applies; when the policy uses MS norms it merges each norm's
affine into the linear(s) reading it (float64, then cast). ``save_pretrained`` writes HF
names back so HF transformers loads the same function: pre-LN models export merged norms
as weight 1, bias 0 with the merged linears; post-LN models (BERT/RoBERTa), whose
residual path keeps gamma/beta, export those and un-merge the linears.
``save_lora_merged`` writes a LoRA model as peft's ``merge_and_unload`` does, streamed
from the checkpoint it was loaded from (its tensors, its dtypes, the adapters merged),
under every policy and base dtype. Both write shards and an index over
:data:`MAX_SHARD_BYTES`, as transformers does.

Bad input is one :class:`CheckpointError` line naming the file or tensor, before any
tensor is read: a path that is no directory, a config.json that is no JSON object or
lacks a field its family needs, an unsupported ``model_type``, a truncated or corrupt
safetensors file, a shard index naming a missing shard or a tensor its shard lacks, and
(from the file headers) every missing, unexpected, mis-shaped or non-float tensor; a
mis-shaped classification head says to load with ``new_head=True``.

Heads: a checkpoint with none (HF's ``ViTModel`` / ``BertModel`` saves: names without
the ``vit.``/``bert.`` prefix or no ``classifier``) keeps the model's fresh head of
``seed``, merged with the final norm under MS norms as a loaded one is; ``new_head=True``
treats a checkpoint's head (the family's ``HF_HEAD_KEYS``) as absent.

Host memory of a streamed load (``load_pretrained(store=...)``, as ``train.model.
build_model`` does with ``base_dtype``), measured by tests/test_hf_stream.py: peak RSS
growth of a load in a fresh process (CPU, 2 shared cores), a synthetic 24-layer LLaMA of
124 MB in fp32 (3 shards), LoRA, MS norms merged, each format's second load (the first
compiles the loader's programs: +0.3-1x once, not growing with the model):

  base_dtype   resident / fp32 model   peak / fp32 model
  bfloat16     0.51                    0.60
  nf4          0.16                    0.28
  float32      1.01                    1.17 (the control; first load of its format)

The excess over the resident model is what is in flight (the largest tensor, 2.1% of
the model here: read with its mapped file pages, merged in float64, copied to the device
and stored, ~4x it) and a few MB of bookkeeping. Before the reader stopped making a
float64 copy of each tensor (and the merge its second one), bf16 peaked at 0.80x on an
81 MB model (0.63x after). On a GPU the rows go to device buffers, so the host holds only
what is in flight (not measured there).
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowmem_jax.cli_checks import folder_problem
from lowmem_jax.memory import write_json
from lowmem_jax.policy import MemoryPolicy
from models import registry
from models.dropout import Dropout
from models.hf_state import (CheckpointError, OutTensor, StateReader, check_store,
                             expected_tensors, header_of, init_unread, merged_tensors,
                             read_state, write_state)
from models.hf_state import Linear as MapLinear


# safetensors dtypes our float models read (bf16 through JAX); an int or bool tensor is
# not a weight of theirs
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class SafetensorsFiles(Mapping):
  """The tensors of a model directory (single file or shards), read one at a time on
  access (``safetensors.safe_open``): nothing is held but the tensor asked for. bf16
  tensors (which numpy lacks) come as float32. Opening checks every file's header (a
  missing shard, a truncated or corrupt file, an index naming a tensor its shard lacks
  are a :class:`CheckpointError` naming the file) and keeps each tensor's shape and dtype
  (:meth:`header`), so a load checks them before it reads any tensor."""

  def __init__(self, path: str | os.PathLike):
    path = _directory(path)
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").exists():  # first, as transformers reads them
      weight_map = None
      if index.exists():
        _warn_once(f"warning: {path} holds both model.safetensors and {index.name}; "
                   "reading model.safetensors, as transformers does (the other is "
                   "likely left from an earlier save: delete whichever is stale)")
    elif index.exists():
      weight_map = _weight_map(index)
    else:
      raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json"
                            + _unread_weights(path))
    files = ["model.safetensors"] if weight_map is None else sorted(set(weight_map.values()))
    self.headers: dict[str, tuple[tuple[int, ...], str]] = {}
    for name in files:
      file = path / name
      if weight_map is None:
        header = _header(file)
        weight_map = {key: name for key in header}
      else:
        keys = sorted(k for k, v in weight_map.items() if v == name)
        if not file.is_file():
          raise CheckpointError(f"{index}: shard {name} does not exist (it holds "
                                f"{len(keys)} tensors, e.g. {keys[0]})")
        header = _header(file)
        lacking = [k for k in keys if k not in header]
        if lacking:
          raise CheckpointError(f"{file} lacks {len(lacking)} tensor(s) that {index.name} "
                                f"maps to it: {', '.join(lacking[:5])}")
      self.headers.update({k: header[k] for k, v in weight_map.items() if v == name})
    self.path, self.weight_map = path, dict(weight_map)

  def header(self, key: str) -> tuple[tuple[int, ...], str]:
    """``(shape, safetensors dtype name)`` of ``key``, from its file's header (no read)."""
    return self.headers[key]

  def __getitem__(self, key: str) -> np.ndarray:
    from safetensors import safe_open
    file = str(self.path / self.weight_map[key])
    with safe_open(file, framework="numpy") as f:
      try:
        return f.get_tensor(key)
      except TypeError:  # a dtype numpy lacks (bfloat16): through JAX, one tensor
        pass
    with safe_open(file, framework="flax") as f:
      return np.asarray(f.get_tensor(key), np.float32)

  def __iter__(self):
    return iter(self.weight_map)

  def __len__(self) -> int:
    return len(self.weight_map)

  def __contains__(self, key) -> bool:
    return key in self.weight_map


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
  """``message`` on stderr, once per process (a directory is opened more than once)."""
  if message not in _WARNED:
    _WARNED.add(message)
    print(message, file=sys.stderr, flush=True)


def _unread_weights(path: Path) -> str:
  """What a directory without safetensors holds instead, and what to do: ``""`` if
  nothing we know."""
  if any(path.glob("pytorch_model*.bin")) or any(path.glob("*.pt")):
    return ("; it holds PyTorch weights (.bin/.pt), which are not read (pickle): convert them "
            "with transformers, AutoModel.from_pretrained(d).save_pretrained(d, "
            "safe_serialization=True)")
  if (path / "adapter_config.json").exists():
    return "; " + _adapter_note(path)
  return ""


def _adapter_note(path: Path) -> str:
  """A peft adapter folder given as a model: which base it adapts."""
  try:
    base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
  except (OSError, ValueError, AttributeError):
    base = None
  return ("it is a peft adapter (adapter_config.json), not a model: give its base model"
          + (f" ({base})" if base else "") + " as pretrained; merge the adapter into it "
          "first (peft's merge_and_unload) to start from the adapted weights")


def _directory(path: str | os.PathLike) -> Path:
  """``path`` as a Path if it is a directory; else a CheckpointError saying what it is."""
  path = Path(path)
  if not path.exists():
    raise CheckpointError(f"{path}: no such directory")
  if not path.is_dir():
    raise CheckpointError(f"{path} is a file; give the model directory (config.json and "
                          "model.safetensors)")
  return path


def _json(file: Path):
  try:
    return json.loads(file.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{file}: not valid JSON ({e})") from None


# transformers' legacy renames, applied on load to every model: the LayerNorm names of
# TF-era checkpoints (the Hub's bert-base-uncased among them)
_LEGACY_NAMES = (("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias"))


def _modern_name(key: str) -> str:
  """``key`` as transformers reads it (:data:`_LEGACY_NAMES`)."""
  for old, new in _LEGACY_NAMES:
    key = key.replace(old, new)
  return key


class _ModernNames(Mapping):
  """``state`` (HF tensors by name, file headers kept) with TF-era names read as today's
  (:data:`_LEGACY_NAMES`), as transformers loads them; a legacy name whose modern twin is
  also there is left out (the twin is read)."""

  def __init__(self, state: Mapping):
    self.state = state
    self.names = {}  # the name a tensor is read by -> its name in ``state``
    for key in state:
      new = _modern_name(key)
      if new == key:
        self.names[key] = key
      elif new not in state:
        self.names[new] = key

  def header(self, key: str):
    return header_of(self.state, self.names[key])

  def __getitem__(self, key: str):
    return self.state[self.names[key]]

  def __iter__(self):
    return iter(self.names)

  def __len__(self) -> int:
    return len(self.names)

  def __contains__(self, key) -> bool:
    return key in self.names


def modern_names(state: Mapping) -> Mapping:
  """``state`` as transformers reads it (:class:`_ModernNames`), or itself where no name
  is a legacy one."""
  return _ModernNames(state) if any(_modern_name(k) != k for k in state) else state


def _weight_map(index: Path) -> dict[str, str]:
  """The ``weight_map`` of a shard index: tensor name -> shard file name."""
  data = _json(index)
  weight_map = data.get("weight_map") if isinstance(data, dict) else None
  if not isinstance(weight_map, dict) or not weight_map or not all(
      isinstance(v, str) for v in weight_map.values()):
    raise CheckpointError(f"{index}: no \"weight_map\" object (tensor name -> shard file)")
  return weight_map


def _header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
  """Each tensor's ``(shape, dtype name)`` in a safetensors file (its header only)."""
  from safetensors import SafetensorError, safe_open
  try:
    with safe_open(str(file), framework="numpy") as f:
      return {key: (tuple(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype())
              for key in f.keys()}
  except SafetensorError as e:  # truncated, corrupt, or not safetensors at all
    raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def read_safetensors(path: str | os.PathLike) -> SafetensorsFiles:
  """All tensors of a model directory (single file or shards): a mapping HF name ->
  numpy array that reads each tensor when asked (``dict(...)`` reads them all)."""
  return SafetensorsFiles(path)


def _read_config(path: Path, overrides: dict):
  """``(family, our config)`` of the HF directory ``path`` with ``overrides``; a bad
  ``config.json`` is a CheckpointError naming it and what is wrong."""
  path = _directory(path)
  config_file = path / "config.json"
  if not config_file.exists():
    raise CheckpointError(f"{path}: no config.json" + (
        "; " + _adapter_note(path) if (path / "adapter_config.json").exists() else ""))
  hf_config = _json(config_file)
  if not isinstance(hf_config, dict):
    raise CheckpointError(f"{config_file}: expected a JSON object, got "
                          f"{type(hf_config).__name__}")
  if "model_type" not in hf_config:
    timm = (f" (a timm checkpoint, architecture {hf_config['architecture']}: not read)"
            if "architecture" in hf_config else "")
    raise CheckpointError(f"{config_file}: no model_type{timm}; supported: "
                          f"{', '.join(registry.hf_model_types())}")
  quantized = hf_config.get("quantization_config")
  if quantized is not None:
    method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
    raise CheckpointError(
        f"{config_file}: a pre-quantized checkpoint (quantization_config, quant_method "
        f"{method}) is not read; give the unquantized checkpoint (base_dtype=nf4 or int8 "
        "stores its frozen weights quantized, as QLoRA)")
  try:
    family = registry.hf_family(hf_config["model_type"])
    cfg = family.module.config_from_hf(hf_config)
  except KeyError as e:
    raise CheckpointError(f"{config_file}: no {e.args[0]!r}, which a "
                          f"{hf_config['model_type']} config needs") from None
  except (CheckpointError, TypeError, ValueError) as e:  # a field's type or value
    raise CheckpointError(f"{config_file}: {e}") from None
  # the overrides' own errors (``--set model.<field>=...``) name the field, not the file
  return family, family.module.config_from_hf(hf_config, **overrides) if overrides else cfg


def config_from_pretrained(path: str | os.PathLike, **overrides):
  """Our config of a HF model directory (its config.json) with ``overrides``: checks
  both without building anything."""
  return _read_config(path, overrides)[1]


def init_from_config(path: str | os.PathLike, *, policy: MemoryPolicy | str = "baseline",
                     dtype=jnp.float32, seed: int = 0, **overrides):
  """The architecture of a HF model directory, randomly initialised (no weights read):
  for shapes and compiled-memory estimates (e.g. under ``nnx.eval_shape``)."""
  family, cfg = _read_config(path, overrides)
  return family.build(cfg, MemoryPolicy.parse(policy), dtype=dtype, rngs=nnx.Rngs(seed))


def load_pretrained(path: str | os.PathLike, *, policy: MemoryPolicy | str = "baseline",
                    dtype=jnp.float32, seed: int = 0, store: Callable | None = None,
                    new_head: bool = False, **overrides):
  """Builds our model from a HF model directory. ``overrides`` change config fields
  (e.g. ``num_labels``); parameters the checkpoint lacks (a new head) are initialised
  from ``seed`` only where the architecture module allows it, otherwise it is an error.
  ``new_head``: the checkpoint's classification head (for other labels) is not read,
  the model's fresh one kept (``transformers``' ``ignore_mismatched_sizes`` for a head).

  Streamed: the model is built abstractly, each tensor is read when its variable is
  filled and put in its final form at once: ``store(path, module)`` names the storage
  (``lowmem_jax.quantized_weight.FORMATS``; None: all float32) of a linear's kernel or
  an embedding's table. Stacked variables fill device buffers row by row (donated
  updates). Variables the checkpoint does not fill (policy state, a fresh head) are
  initialised by one jitted build that returns only them. Host memory: one tensor in
  flight beyond what the device holds (module docstring: measured).

  Dropout (where the model has it and config.json sets rates) is off in the model returned,
  as in transformers' ``from_pretrained``: ``model.train()`` turns it on (the trainer does),
  ``model.eval()`` off again."""
  family, cfg = _read_config(path, overrides)
  policy = MemoryPolicy.parse(policy)

  def build():
    return family.build(cfg, policy, dtype=dtype, rngs=nnx.Rngs(seed))

  state, ignore = _pretrained_state(path, family, new_head)
  entries = family.module.hf_map(cfg, frozenset(state))
  # a map entry that reads the model's own initial weights needs them built for real
  fresh = any(isinstance(e, MapLinear) and e.keep_weights for e in entries)
  model = build() if fresh else nnx.eval_shape(build)
  _read(model, state, entries, store, source=str(path), ignore=ignore)
  kept = [e.path for e in entries if isinstance(e, MapLinear) and e.keep_weights]
  if kept and not isinstance(path, Mapping):  # as transformers' "newly initialized" list
    _warn_once(f"note: {path} has no {', '.join(kept)} for this model: initialised from "
               f"seed {seed}, trained from there")
  init_unread(model, build)
  model.set_attributes(Dropout, deterministic=True, raise_if_not_found=False)
  return model


def check_pretrained(path: str | os.PathLike, *, policy: MemoryPolicy | str = "baseline",
                     new_head: bool = False, **overrides) -> None:
  """What :func:`load_pretrained` would refuse, from the config and the file headers
  alone (nothing built, no tensor read): a :class:`CheckpointError` naming it."""
  family, cfg = _read_config(path, overrides)
  policy = MemoryPolicy.parse(policy)
  state, ignore = _pretrained_state(path, family, new_head)
  model = nnx.eval_shape(lambda: family.build(cfg, policy, dtype=jnp.float32,
                                              rngs=nnx.Rngs(0)))
  _reader(model, state, family.module.hf_map(cfg, frozenset(state)), str(path), ignore)


class _Without(Mapping):
  """``state`` less the keys that start with ``prefixes`` (file headers kept)."""

  def __init__(self, state, prefixes: tuple[str, ...]):
    self.state, self.prefixes = state, prefixes

  def header(self, key: str):
    return header_of(self.state, key)

  def __getitem__(self, key: str):
    if key.startswith(self.prefixes):
      raise KeyError(key)
    return self.state[key]

  def __iter__(self):
    return (k for k in self.state if not k.startswith(self.prefixes))

  def __len__(self) -> int:
    return sum(1 for _ in self)

  def __contains__(self, key) -> bool:
    return key in self.state and not key.startswith(self.prefixes)


def _pretrained_state(path, family: registry.Family, new_head: bool):
  """The tensors of ``path`` (a directory, or HF tensors by name) a load reads (less the
  head under ``new_head``), and the key prefixes it may leave unread."""
  state = modern_names(path if isinstance(path, Mapping) else read_safetensors(path))
  if not new_head:
    return state, ()
  head = getattr(family.module, "HF_HEAD_KEYS", ())
  if not head:
    raise CheckpointError(f"new_head: a {family.class_name} has no classification head "
                          "to replace")
  return _Without(state, head), head


def load_state(model, state: Mapping[str, np.ndarray], *, store: Callable | None = None) -> None:
  """Loads HF tensors ``state`` into ``model`` (in place) by its family's map; every
  missing, unexpected or mis-shaped key is named in one CheckpointError. ``store``: as
  :func:`load_pretrained`'s."""
  module = registry.hf_family(model.cfg.model_type).module
  state = modern_names(state)
  _read(model, state, module.hf_map(model.cfg, frozenset(state)), store)


def _reader(model, state, entries, source: str, ignore=()) -> StateReader:
  """A reader of ``state`` for ``entries``, checked against the map (names, shapes,
  dtypes: from file headers, before any tensor is read). A mis-shaped head says how to
  replace it."""
  module = registry.hf_family(model.cfg.model_type).module
  reader = StateReader(state, ignore=module.HF_IGNORED_KEYS + tuple(ignore), source=source)
  expected = expected_tensors(model, entries)
  try:
    reader.check(expected)
  except CheckpointError as e:
    head = getattr(module, "HF_HEAD_KEYS", ())
    if head and any(k.startswith(head) and k in state and expected[k] is not None
                    and header_of(state, k)[0] != tuple(expected[k]) for k in expected):
      raise CheckpointError(f"{e} (the checkpoint's head is for other labels: load with "
                            "new_head=True, or train with new_head=true)") from None
    # only head keys wrong (another task's head: a token classifier's): the same way out
    wrong = [k for k in expected if k not in state] + reader.unexpected(set(expected))
    if wrong == ["lm_head.weight"]:  # a LlamaModel save of untied embeddings
      raise CheckpointError(f"{e} (a base-model save without the LM head, whose "
                            "embeddings are not tied: give the *ForCausalLM checkpoint)") from None
    if head and not ignore and wrong and all(
        any(h in k for h in head) for k in wrong):
      raise CheckpointError(f"{e} (the checkpoint's head is another task's: load with "
                            "new_head=True, or train with new_head=true)") from None
    raise
  return reader


def _read(model, state, entries, store, source: str = "", ignore=()) -> None:
  """Checks ``state`` against the map (:func:`_reader`), then reads it into ``model``."""
  reader = _reader(model, state, entries, source, ignore)
  check_store(model, entries, store)
  read_state(model, entries, reader, store=store)
  reader.finish()


def _export_family(model, caller: str = "save_pretrained") -> registry.Family:
  """``model``'s family, if it has a HF format and holds plain fp32 weights (no adapters,
  none stored in a base dtype); else a ValueError saying what to do."""
  from models.linear import FrozenKernel
  from models.lora import LoRALinear
  family = registry.family_of(model)
  if not family.hf_model_types:
    formats = ", ".join(f.class_name for f in registry.FAMILIES if f.hf_model_types)
    raise ValueError(f"{caller}: {family.class_name} has no Hugging Face format "
                     f"(those with one: {formats})")
  adapted = sorted({p[-1] for p, n in nnx.iter_graph(model) if isinstance(n, LoRALinear)})
  if adapted:
    raise ValueError(f"save_pretrained: the model has LoRA adapters (on "
                     f"{', '.join(map(str, adapted))}), which HF's format has no place for: "
                     "export lora.strip_lora(model) (merges them), or "
                     "save_lora_merged(model, path, pretrained) (merged into the "
                     "checkpoint's own tensors)")
  stored = [(".".join(map(str, p)), v.get_value().storage) for p, v in nnx.iter_graph(model)
            if isinstance(v, FrozenKernel)]
  if stored:
    raise ValueError(f"save_pretrained: {len(stored)} frozen weight(s) are stored in a base "
                     f"dtype (e.g. {stored[0][0]} as {stored[0][1]}); the export would hold "
                     "their dequantized values, not the checkpoint's: export a model loaded "
                     "with base_dtype float32 (no store), or a LoRA model with "
                     "save_lora_merged(model, path, pretrained)")
  return family


def hf_state(model) -> dict[str, np.ndarray]:
  """``model``'s tensors under HF names (torch layout, float32)."""
  module = _export_family(model).module
  return write_state(model, module.hf_map(model.cfg))


# The largest file an export writes (transformers 4's default max_shard_size, "5GB";
# transformers 5 writes up to 50GB): the host holds one file's tensors at a time
MAX_SHARD_BYTES = 5 * 10 ** 9
# numpy dtype -> HF config.json's dtype name
_TORCH_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                 np.dtype(jnp.bfloat16): "bfloat16", np.dtype(np.float64): "float64"}
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _shards(tensors: Sequence[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
  """``tensors`` in order, cut into files of at most ``max_bytes`` (one larger tensor
  alone), as transformers' ``save_pretrained`` cuts them."""
  shards, size = [[]], 0
  for t in tensors:
    if shards[-1] and size + t.nbytes > max_bytes:
      shards.append([])
      size = 0
    shards[-1].append(t)
    size += t.nbytes
  return shards


def _with_dtype(config: dict, tensors: Sequence[OutTensor]) -> dict:
  """``config`` naming the dtype most of the tensors' bytes are in, under the key(s) its
  family writes (``torch_dtype``, transformers 5's ``dtype``); ``dtype`` where it writes
  none and that is not float32 (transformers loads a model in it)."""
  by_dtype = collections.Counter()
  for t in tensors:
    by_dtype[t.dtype] += t.nbytes
  name = _TORCH_DTYPES.get(by_dtype.most_common(1)[0][0]) if tensors else None
  keys = [k for k in ("torch_dtype", "dtype") if k in config]
  if name is None or not keys and name == "float32":
    return config
  return {**config, **dict.fromkeys(keys or ["dtype"], name)}


def _write_model_dir(path: Path, config: dict, tensors: Sequence[OutTensor],
                     max_shard_bytes: int | None) -> None:
  """Writes ``config.json`` and the tensors, as ``model.safetensors`` or (over
  ``max_shard_bytes``) shards ``model-0000i-of-0000n.safetensors`` with
  ``model.safetensors.index.json``: one shard's tensors made and held at a time, each
  file written whole under a temporary name (removed on an error) and renamed; an index
  is written after its shards, an old one removed after a single file is in place, and
  a previous export's weight files that this one does not write last. config.json names
  the dtype (:func:`_with_dtype`)."""
  from safetensors.numpy import save_file

  path.mkdir(parents=True, exist_ok=True)
  shards = _shards(tensors, MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes)
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
  umask = os.umask(0)
  os.umask(umask)
  try:
    for name, shard in zip(names, shards):
      tmp = path / f"{name}.tmp"
      save_file({t.name: np.ascontiguousarray(t.make()) for t in shard}, str(tmp),
                metadata={"format": "pt"})
      os.chmod(tmp, 0o666 & ~umask)  # safetensors writes 0600; a model file is shared
  except BaseException:
    for name in names:
      (path / f"{name}.tmp").unlink(missing_ok=True)
    raise
  index = path / "model.safetensors.index.json"
  for name in names:
    os.replace(path / f"{name}.tmp", path / name)
  if len(shards) == 1:
    index.unlink(missing_ok=True)  # an old index names old shards: the new file takes over
  else:
    weight_map = {t.name: name for name, shard in zip(names, shards) for t in shard}
    write_json(str(index), {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                            "weight_map": weight_map}, announce=False)
  for stale in [*path.iterdir()]:
    if stale.name not in names and (stale.name == "model.safetensors"
                                    or _SHARD_NAME.fullmatch(stale.name)):
      stale.unlink()
  write_json(str(path / "config.json"), _with_dtype(config, tensors), announce=False)


# another model's weights or adapter: left in an export's folder, transformers loads the
# adapter beside the export, and the others pass for it (HF Trainer's training_args.bin,
# tokenizer and processor files are no weights: kept)
FOREIGN_WEIGHTS = re.compile(r"adapter_config\.json|adapter_model\.\w+|"
                             r"pytorch_model(-\d+-of-\d+)?\.bin(\.index\.json)?|"
                             r"tf_model\.h5|flax_model\.msgpack")


def check_export_dir(path: str | os.PathLike, subject: str | None = None,
                     base: str | os.PathLike | None = None,
                     run_dir: str | os.PathLike | None = None) -> Path:
  """``path`` as a Path, or a ValueError saying why an export cannot go there: a file, a
  folder that cannot be made or written (:func:`~lowmem_jax.cli_checks.folder_problem`),
  ``base`` itself (the checkpoint the model was loaded from: the export would overwrite
  it), ``run_dir`` (a training run's folder: its config.json would be replaced), or
  holding another model's weight or adapter files (:data:`FOREIGN_WEIGHTS`). ``subject``
  begins the message (default ``save_pretrained: <path>``)."""
  path = Path(path)
  subject = subject or f"save_pretrained: {path}"
  problem = folder_problem(path)
  if problem:
    raise ValueError(f"{subject} {problem}")
  if base is not None and path.is_dir() and os.path.samefile(path, base):
    raise ValueError(f"{subject} is the checkpoint the model was loaded from; the export "
                     "would overwrite it: name another folder")
  if run_dir is not None and os.path.realpath(path) == os.path.realpath(run_dir):
    raise ValueError(f"{subject} is the run's folder; the export's config.json would replace "
                     "the run's (and --resume with it): name another folder")
  foreign = sorted(p.name for p in path.iterdir() if FOREIGN_WEIGHTS.fullmatch(p.name)) \
      if path.is_dir() else []
  if foreign:
    raise ValueError(f"{subject} holds {', '.join(foreign)}: another model's weights or "
                     "adapter, which transformers would load with the export or take for it; "
                     "remove them or name another folder")
  return path


def with_labels(config: dict, labels: Sequence[str] | None) -> dict:
  """A classifier's HF ``config`` with ``id2label``/``label2id`` naming its classes
  (``labels[i]`` for id i; ids past them keep ``LABEL_<i>``); as it is without
  ``labels`` or without a label map (an LM)."""
  if not labels or "id2label" not in config:
    return config
  n = len(config["id2label"])
  if len(labels) > n:
    raise ValueError(f"{len(labels)} label names for a head of {n} labels")
  names = [str(x) for x in labels] + [f"LABEL_{i}" for i in range(len(labels), n)]
  return {**config, "id2label": {str(i): name for i, name in enumerate(names)},
          "label2id": {name: i for i, name in enumerate(names)}}


def checkpoint_labels(path: str | os.PathLike, num_labels: int | None = None
                      ) -> list[str] | None:
  """A HF classifier directory's class names by id (its config.json's ``id2label``; only
  if there are ``num_labels`` of them, where given), or None where it has no usable
  one."""
  try:
    config = json.loads((Path(path) / "config.json").read_text())
    id2label = config.get("id2label") or {}
    names = [str(id2label[k]) for k in sorted(id2label, key=int)]
  except (OSError, ValueError, AttributeError, TypeError, KeyError):
    return None
  if not names or sorted(map(int, id2label)) != list(range(len(names))):
    return None
  return names if num_labels is None or len(names) == num_labels else None


def dropout_fields(path: str | os.PathLike) -> list[str]:
  """``"field=value"`` for each dropout probability above 0 a HF directory's config.json
  sets (``hidden_dropout_prob``, ``attention_dropout``, ...): for the models without dropout
  (ViT, LLaMA; BERT/RoBERTa read their rates), whose fine-tune from it trains without what
  transformers' would use."""
  try:
    config = json.loads((Path(path) / "config.json").read_text())
    return [f"{k}={v}" for k, v in config.items() if "dropout" in k
            and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]
  except (OSError, ValueError, AttributeError):
    return []


def has_head(path: str | os.PathLike) -> bool:
  """Whether a HF classifier directory's weights hold its classification head (the
  family's ``HF_HEAD_KEYS``; read from the file headers): a ``ViTModel`` saved from a
  classifier keeps its ``id2label`` but no head."""
  config = json.loads((Path(path) / "config.json").read_text())
  head = getattr(registry.hf_family(config["model_type"]).module, "HF_HEAD_KEYS", ())
  return any(key.startswith(head) for key in modern_names(read_safetensors(path)))


def save_pretrained(model, path: str | os.PathLike, *,
                    max_shard_bytes: int | None = None,
                    labels: Sequence[str] | None = None) -> None:
  """Writes ``config.json`` and ``model.safetensors`` in HF format (float32; shards over
  ``max_shard_bytes``, default :data:`MAX_SHARD_BYTES`), each file atomically; a
  classifier's ``labels`` name its classes in the config (:func:`with_labels`)."""
  module = _export_family(model).module
  path = check_export_dir(path)
  tensors = [OutTensor(k, tuple(v.shape), v.dtype, lambda v=v: v)
             for k, v in hf_state(model).items()]
  _write_model_dir(path, with_labels(module.config_to_hf(model.cfg), labels), tensors,
                   max_shard_bytes)


def save_lora_merged(model, path: str | os.PathLike, base: str | os.PathLike | Mapping, *,
                     new_head: bool = False, max_shard_bytes: int | None = None,
                     labels: Sequence[str] | None = None) -> None:
  """Writes a LoRA model (:mod:`models.lora`, any policy and base dtype) in HF format as
  peft's ``merge_and_unload`` does: the checkpoint it was loaded from (``base``: its
  directory, or HF tensors by name) with each adapter's ``scale * A @ B`` added to its
  linear's weight and the linears trained in full (the head) put in; every other tensor
  the checkpoint's own, bit for bit, in its dtype (:func:`models.hf_state.merged_tensors`).
  ``new_head``: as the load (the checkpoint's head was not read; if it was, and no
  ``labels`` are given, base's class names are kept). Streamed: tensors are
  read from ``base`` and written a shard at a time (``max_shard_bytes``, default
  :data:`MAX_SHARD_BYTES`), so the host holds one shard, not the model. ``base`` must
  hold the values the model was loaded from: the train loop checks its fingerprint
  (:mod:`train.pretrained_record`); only missing tensors and shapes are checked here."""
  from models.lora import LoRALinear, LoRAParam
  family = registry.family_of(model)
  if not family.hf_model_types:
    _export_family(model, "save_lora_merged")  # the error naming the families with a format
  if not any(isinstance(n, LoRALinear) for _, n in nnx.iter_graph(model)):
    raise ValueError("save_lora_merged: the model has no LoRA adapters (never applied, or "
                     "merged by strip_lora): export it with save_pretrained")
  module = family.module
  path = check_export_dir(path, f"save_lora_merged: {path}",
                          None if isinstance(base, Mapping) else base)
  state, _ = _pretrained_state(base, registry.hf_family(model.cfg.model_type), new_head)
  tensors = merged_tensors(model, module.hf_map(model.cfg), state,
                           module.hf_map(model.cfg, frozenset(state)),
                           lambda var: isinstance(var, LoRAParam))
  config = module.config_to_hf(model.cfg)
  if labels is None and not new_head and not isinstance(base, Mapping):  # the head was read
    labels = checkpoint_labels(base, len(config.get("id2label", ())))
  _write_model_dir(path, with_labels(config, labels), tensors, max_shard_bytes)
