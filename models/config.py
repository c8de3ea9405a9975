"""Building a model config from a named preset plus overrides, with clear errors."""

from __future__ import annotations

import dataclasses


def replace_fields(cfg, overrides: dict):
  """``dataclasses.replace(cfg, **overrides)``; unknown fields name the valid ones."""
  fields = {f.name for f in dataclasses.fields(cfg)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown {type(cfg).__name__} field(s) {', '.join(unknown)}; valid: "
                     f"{', '.join(sorted(fields))}")
  return dataclasses.replace(cfg, **overrides)


def make_config(cls, presets: dict, name: str, overrides: dict):
  """The preset ``name`` (a field dict or a ``cls`` instance) with ``overrides`` applied;
  unknown presets and fields name the valid ones."""
  if name not in presets:
    raise ValueError(f"unknown {cls.__name__} preset {name!r}; valid: {', '.join(presets)}")
  preset = presets[name]
  return replace_fields(preset if isinstance(preset, cls) else cls(**preset), overrides)
