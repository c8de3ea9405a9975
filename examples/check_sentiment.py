"""Checks examples/sentiment_{train,test}.jsonl: format, counts, label balance, word counts,
no duplicate and no near-copy within or across the two files.

    python examples/check_sentiment.py            # exit status 1 and one line per problem

A near-copy is a pair whose word sets overlap with Jaccard similarity >= NEAR (after lower-casing
and dropping punctuation); pairs among the first 80 lines of the original files are exempt.
"""
import itertools
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = {"sentiment_train.jsonl": 600, "sentiment_test.jsonl": 400}
ORIGINAL = {"sentiment_train.jsonl": 60, "sentiment_test.jsonl": 20}  # the lines kept first
MIN_WORDS, MAX_WORDS = 4, 30
NEAR = 0.5


def words(text: str) -> list[str]:
  return re.findall(r"[a-z0-9']+", text.lower())


def read(path: Path) -> list[dict]:
  rows = []
  for number, line in enumerate(path.read_text().splitlines(), 1):
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:  # a blank line too: each line is one example
      raise ValueError(f"{path.name}:{number}: not a JSON object ({e.msg})") from None
    if (not isinstance(row, dict) or set(row) != {"text", "label"}
        or type(row["label"]) is not int or row["label"] not in (0, 1)
        or not isinstance(row["text"], str)):  # type: true and 1.0 are not labels
      raise ValueError(f"{path.name}:{number}: want {{'text': str, 'label': 0|1}}, got {row!r}")
    rows.append(dict(row, where=f"{path.name}:{number}", original=number <= ORIGINAL[path.name]))
  return rows


def problems(folder: Path = HERE) -> list[str]:
  found, everything = [], []
  for name, count in FILES.items():
    rows = read(folder / name)
    everything += rows
    positives = sum(r["label"] for r in rows)
    if len(rows) != count or 2 * positives != count:
      found.append(f"{name}: {len(rows)} lines, {positives} positive; want {count}, half positive")
  seen = {}
  for row in everything:
    n = len(words(row["text"]))
    if not MIN_WORDS <= n <= MAX_WORDS and not row["original"]:
      found.append(f"{row['where']}: {n} words, want {MIN_WORDS}-{MAX_WORDS}")
    key = " ".join(words(row["text"]))
    if key in seen:
      found.append(f"{row['where']}: duplicate of {seen[key]}")
    seen.setdefault(key, row["where"])
  sets = [(row, set(words(row["text"]))) for row in everything]
  for (a, wa), (b, wb) in itertools.combinations(sets, 2):
    similarity = len(wa & wb) / len(wa | wb)
    if similarity >= NEAR and not (a["original"] and b["original"]):
      found.append(f"{a['where']} ~ {b['where']}: near-copy (word Jaccard {similarity:.2f})")
  return found


if __name__ == "__main__":
  import argparse
  argparse.ArgumentParser(prog="python examples/check_sentiment.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
  try:
    found = problems()
  except ValueError as e:  # a line that is no example: the checks below cannot run
    found = [str(e)]
  print("\n".join(found) or "ok: " + ", ".join(f"{n} {c} lines" for n, c in FILES.items()))
  sys.exit(1 if found else 0)
