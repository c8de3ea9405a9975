"""JSON-lines records (or one JSON array of objects) with errors naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path

from train.dataset import MissingFileError


def read_text(path: Path) -> str:
  """A data file's text (UTF-8, a BOM dropped); a file that is not UTF-8 is a ValueError
  naming it and the line of the first bad byte."""
  data = Path(path).read_bytes()
  try:
    return data.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    line = data[:e.start].count(b"\n") + 1
    raise ValueError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start}); save "
                     "the file as UTF-8") from None


def read_jsonl(path) -> list[tuple[str, dict]]:
  """(where, object) for every record: one per non-blank line of a jsonl file, where is
  "file:line"; or, for a file holding one JSON array (Alpaca's .json), "file[item]"."""
  p = Path(path)
  if p.is_dir():
    raise ValueError(f"data {p} is a folder; this task reads a .jsonl file (one JSON "
                     "object per line) or a .json array")
  if not p.is_file():
    raise MissingFileError(f"data file not found: {p}")
  if p.suffix.lower() in (".csv", ".tsv"):
    raise ValueError(f"{p}: CSV/TSV is not read; write it as JSON lines, one object per "
                     "row (pandas: pd.read_csv(f, sep=',' or '\\t').to_json(out, "
                     "orient='records', lines=True))")
  text = read_text(p)
  if (p.suffix.lower() == ".json" and text.lstrip().startswith("{")
      and len([line for line in text.split("\n") if line.strip()]) > 1):  # not JSON lines
    try:
      obj = json.loads(text)
    except json.JSONDecodeError:
      obj = None  # not one object: read as lines below
    if isinstance(obj, dict):
      raise ValueError(f"{p}: a .json file must hold an array of records (got one object "
                       f"with keys {sorted(obj)[:8]}); wrap it in [...] or write one record "
                       "per line as .jsonl")
  if text.lstrip().startswith("["):
    try:
      items = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"{p}:{e.lineno}: bad json: {e.msg}") from None
    records = [(f"{p}[{i}]", obj) for i, obj in enumerate(items)]
  else:
    records = []
    for line_no, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 is valid
      if not line.strip():
        continue
      try:
        records.append((f"{p}:{line_no}", json.loads(line)))
      except json.JSONDecodeError as e:
        raise ValueError(f"{p}:{line_no}: bad json line: {e.msg}") from None
  for where, obj in records:
    if not isinstance(obj, dict):
      raise ValueError(f"{where}: expected a json object, got {type(obj).__name__}")
  if not records:
    raise ValueError(f"empty dataset: {p} has no examples")
  return records


def field(where: str, obj: dict, key: str, *, kind=str, optional: bool = False):
  """``obj[key]`` checked for type; ValueError naming the file, line and key."""
  if key not in obj or obj[key] is None:
    if optional:
      return None
    if key in obj:
      raise ValueError(f"{where}: {key!r} is null")
    raise ValueError(f"{where}: missing key {key!r} (has {sorted(obj)})")
  value = obj[key]
  if not isinstance(value, kind) or isinstance(value, bool):
    kinds = kind if isinstance(kind, tuple) else (kind,)
    raise ValueError(f"{where}: {key!r} must be {' or '.join(k.__name__ for k in kinds)}, "
                     f"got {type(value).__name__}")
  if isinstance(value, str):
    try:
      value.encode("utf-8")
    except UnicodeEncodeError as e:  # a JSON escape such as "\ud83d" with its pair cut off
      raise ValueError(f"{where}: {key!r} has an unpaired UTF-16 surrogate "
                       f"({value[e.start]!r} at character {e.start}); fix or drop that "
                       "character") from None
  return value
