"""What every model shares before its layers: its config from a named preset plus
overrides, its policy and dtype, and its token-input check, each with clear errors."""

from __future__ import annotations

import dataclasses
import difflib

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowmem_jax.policy import MemoryPolicy


# The scalar types a config field may be annotated with, and the values each accepts.
_SCALARS = {"int": int, "float": (int, float), "bool": bool, "str": str, "None": type(None)}


def replace_fields(cfg, overrides: dict):
  """``dataclasses.replace(cfg, **overrides)``; unknown fields name the valid ones, and a
  value of the wrong type for a scalar field (``int``, ``float``, ``bool``, ``str``,
  ``... | None``) names the field and the type it expects (an int for a float is made
  one)."""
  fields = {f.name: f for f in dataclasses.fields(cfg)}
  unknown = sorted(set(overrides) - set(fields))
  if unknown:
    near = [m[0] for name in unknown
            if (m := difflib.get_close_matches(name, fields, n=1, cutoff=0.7))]
    raise ValueError(f"unknown {type(cfg).__name__} field(s) {', '.join(unknown)}"
                     + (f" (did you mean {', '.join(near)}?)" if near else "")
                     + f"; valid: {', '.join(sorted(fields))}")
  checked = {name: _checked(type(cfg).__name__, fields[name], value)
             for name, value in overrides.items()}
  return dataclasses.replace(cfg, **checked)


def _checked(owner: str, field: dataclasses.Field, value):
  kinds = [k.strip() for k in str(field.type).split("|")]
  if not all(k in _SCALARS for k in kinds):
    return value  # not a scalar field: the config's own checks apply
  for kind in kinds:
    if isinstance(value, _SCALARS[kind]) and not (
        isinstance(value, bool) and kind in ("int", "float")):
      return float(value) if kind == "float" else value
  raise ValueError(f"{owner}: {field.name} expects {' or '.join(kinds)}, got {value!r}")


_HF_KINDS = {int: ("an int", int), float: ("a number", (int, float)), bool: ("true or false", bool)}
_REQUIRED = object()


def hf_value(hf, key: str, kind: type, default=_REQUIRED):
  """``hf[key]`` of a HF ``config.json`` dict as ``kind`` (int, float or bool; JSON's
  number or true/false, a bool never a number), ``default`` where it is absent or null:
  a ValueError naming the key otherwise (``models.hf`` heads it with the file's path),
  where ``int(...)``/``bool(...)`` would name neither or read the string "false" as
  true."""
  value = hf.get(key)
  if value is None:
    if default is _REQUIRED:
      raise KeyError(key)
    return default
  what, types = _HF_KINDS[kind]
  if isinstance(value, bool) != (kind is bool) or not isinstance(value, types):
    raise ValueError(f"{key}={value!r} is not {what}")
  return kind(value)


def check_positive(cfg, ints=(), numbers=()):
  """Raises naming the first of ``cfg``'s fields ``ints`` that is not a positive int, or
  ``numbers`` not a positive number (a config's own check, for direct construction
  too)."""
  for names, kinds, what in ((ints, (int, np.integer), "int"),
                             (numbers, (int, float, np.integer, np.floating), "number")):
    for name in names:
      value = getattr(cfg, name)
      if isinstance(value, (bool, np.bool_)) or not isinstance(value, kinds) \
          or not value > 0:
        raise ValueError(f"{type(cfg).__name__}: {name} must be a positive {what}, got "
                         f"{value!r}")


def make_config(cls, presets: dict, name: str, overrides: dict):
  """The preset ``name`` (a field dict or a ``cls`` instance) with ``overrides`` applied;
  unknown presets and fields name the valid ones."""
  if name not in presets:
    raise ValueError(f"unknown {cls.__name__} preset {name!r}; valid: {', '.join(presets)}")
  preset = presets[name]
  return replace_fields(preset if isinstance(preset, cls) else cls(**preset), overrides)


def init_model(model, cfg, config_fn, cfg_cls, policy, dtype, rngs, *, reversible=False):
  """The common start of a model's ``__init__``: sets ``model.cfg`` (a ``cfg_cls`` or a
  preset name for ``config_fn``), ``model.policy`` (checked against the architecture,
  ``reversible`` or not) and
  ``model.dtype``; returns ``rngs`` (``nnx.Rngs(0)`` if None)."""
  cfg = config_fn(cfg) if isinstance(cfg, str) else cfg
  name = type(model).__name__
  if not isinstance(cfg, cfg_cls):
    raise TypeError(f"{name}: expected a {cfg_cls.__name__} or preset name, got "
                    f"{type(cfg).__name__}")
  model.cfg = cfg
  model.policy = MemoryPolicy.parse(policy)
  model.policy.check_architecture(name, reversible=reversible)
  model.dtype = compute_dtype(name, dtype)
  return nnx.Rngs(0) if rngs is None else rngs


def compute_dtype(model: str, dtype):
  """``dtype`` as a float ``jnp.dtype`` (the compute dtype of ``model``), or a ValueError
  naming it: a typo or an int dtype failed deep in numpy or in the first layer's init."""
  try:
    value = jnp.dtype(dtype)
  except TypeError:
    value = None
  if value is None or not jnp.issubdtype(value, jnp.floating):
    shown = repr(dtype) if value is None else value.name
    raise ValueError(f"{model}: dtype {shown} is not a float dtype; use jnp.float32, "
                     "jnp.bfloat16 or jnp.float16 (or their names)")
  return value


def derived_presets(prefix: str, base_presets, base_config, model: str):
  """``(PRESETS, config)`` of a family whose presets are another's with a name prefix
  (``revvit-b16`` has the sizes of ``vit-b16``)."""
  presets = tuple(prefix + name for name in base_presets)

  def config(name: str, **overrides):
    if name not in presets:
      raise ValueError(f"unknown {model} preset {name!r}; valid: {', '.join(presets)}")
    return base_config(name[len(prefix):], **overrides)

  return presets, config


def token_ids(tokens, model: str, max_len: int):
  """``tokens`` as an int array ``[batch, seq]`` of at most ``max_len`` positions, or a
  ValueError naming ``model`` and what is wrong."""
  tokens = jnp.asarray(tokens)
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{model} expects int tokens [batch, seq], got {tokens.dtype}"
                     f"{list(tokens.shape)}")
  if tokens.shape[1] > max_len:
    raise ValueError(f"{model}: sequence length {tokens.shape[1]} exceeds the {max_len} "
                     "positions of the model")
  return tokens
