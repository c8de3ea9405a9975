"""Building a model config from a named preset plus overrides, with clear errors."""

from __future__ import annotations

import dataclasses


def make_config(cls, presets: dict[str, dict], name: str, overrides: dict):
  """``cls(**presets[name], **overrides)``; unknown presets and fields name the valid ones."""
  if name not in presets:
    raise ValueError(f"unknown {cls.__name__} preset {name!r}; valid: {', '.join(presets)}")
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown {cls.__name__} field(s) {', '.join(unknown)}; valid: "
                     f"{', '.join(sorted(fields))}")
  return cls(**{**presets[name], **overrides})
