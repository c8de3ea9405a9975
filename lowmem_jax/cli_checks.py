"""Argument checks the command-line tools share: a bad value is one argparse error line
(exit 2) naming the flag and the value, before any work (no compile, no folder made).

Each check takes the parser, the parsed namespace and flags (``"--mlp-dim"`` reads
``args.mlp_dim``); a flag left unset (``None``) passes.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def _value(args: argparse.Namespace, flag: str):
  return getattr(args, flag.lstrip("-").replace("-", "_"))


def at_least(ap: argparse.ArgumentParser, args: argparse.Namespace, *flags: str,
             minimum: int = 1) -> None:
  """``--batch must be >= 1, got 0`` for the first of ``flags`` below ``minimum``."""
  for flag in flags:
    value = _value(args, flag)
    if value is not None and not value >= minimum:
      ap.error(f"{flag} must be >= {minimum}, got {value}")


def above(ap: argparse.ArgumentParser, args: argparse.Namespace, *flags: str,
          bound: float = 0) -> None:
  """``--budget must be > 0, got -1.0`` for the first of ``flags`` not above ``bound``
  (NaN included)."""
  for flag in flags:
    value = _value(args, flag)
    if value is not None and not value > bound:
      ap.error(f"{flag} must be > {bound}, got {value}")


def output_file(ap: argparse.ArgumentParser, args: argparse.Namespace, *flags: str) -> None:
  """Each of ``flags`` names a file that can be written: not a directory, in a directory
  that exists and is writable."""
  for flag in flags:
    path = _value(args, flag)
    if not path:
      continue
    parent = Path(path).parent
    if os.path.isdir(path):
      ap.error(f"{flag} {path} is a directory; give a file name")
    if not parent.exists():
      ap.error(f"{flag} {path}: the directory {parent} does not exist")
    if not parent.is_dir():
      ap.error(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
      ap.error(f"{flag} {path}: the directory {parent} is not writable")


def folder_problem(path: str | os.PathLike) -> str | None:
  """Why ``path`` cannot be a folder written into (it is a file, a file is on its path,
  its nearest existing ancestor is not writable), or None."""
  if os.path.exists(path) and not os.path.isdir(path):
    return "is a file, not a directory"
  if os.path.islink(path) and not os.path.exists(path):
    return f"is a link to {os.readlink(path)}, which does not exist"
  existing = Path(path)
  while not existing.exists():
    existing = existing.parent
  if not existing.is_dir():
    return f"cannot be made: {existing} is a file, not a directory"
  if not os.access(existing, os.W_OK | os.X_OK):
    return f"cannot be written: the directory {existing} is not writable"
  return None


def output_dir(ap: argparse.ArgumentParser, args: argparse.Namespace, *flags: str) -> None:
  """Each of ``flags`` names a directory that exists or can be made
  (:func:`folder_problem`)."""
  for flag in flags:
    path = _value(args, flag)
    problem = folder_problem(path) if path else None
    if problem:
      ap.error(f"{flag} {path} {problem}")
