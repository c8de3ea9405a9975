"""The shared argument checks: one argparse error line naming the flag and the value."""

import argparse
import os

from conftest import cli_error
from lowmem_jax import cli_checks


def _main(check, *flags, **kwargs):
  """A command with ``--n`` (int), ``--x`` (float), ``--out-file`` and ``--out-dir``."""
  def main(argv):
    ap = argparse.ArgumentParser(prog="cmd")
    ap.add_argument("--n", type=int)
    ap.add_argument("--x", type=float)
    ap.add_argument("--out-file")
    ap.add_argument("--out-dir")
    check(ap, ap.parse_args(argv), *flags, **kwargs)
    return "ran"
  return main


def test_bounds(capsys):
  at_least = _main(cli_checks.at_least, "--n", minimum=2)
  assert at_least([]) == at_least(["--n", "2"]) == "ran"  # unset passes
  assert cli_error(at_least, ["--n", "1"], capsys) == "--n must be >= 2, got 1"
  above = _main(cli_checks.above, "--x")
  assert above(["--x", "0.5"]) == "ran"
  assert cli_error(above, ["--x", "0"], capsys) == "--x must be > 0, got 0.0"
  assert cli_error(above, ["--x", "nan"], capsys) == "--x must be > 0, got nan"


def test_output_file(tmp_path, capsys):
  main = _main(cli_checks.output_file, "--out-file")
  assert main(["--out-file", str(tmp_path / "new.json")]) == "ran"
  (tmp_path / "f").write_text("")
  assert main(["--out-file", str(tmp_path / "f")]) == "ran"  # rewritten
  for path, message in ((tmp_path, f"{tmp_path} is a directory; give a file name"),
                        (tmp_path / "no" / "a.json",
                         f"{tmp_path / 'no' / 'a.json'}: the directory {tmp_path / 'no'} "
                         "does not exist"),
                        (tmp_path / "f" / "a.json",
                         f"{tmp_path / 'f' / 'a.json'}: {tmp_path / 'f'} is not a directory")):
    assert cli_error(main, ["--out-file", str(path)], capsys) == f"--out-file {message}"


def test_output_dir(tmp_path, capsys, monkeypatch):
  main = _main(cli_checks.output_dir, "--out-dir")
  assert main(["--out-dir", str(tmp_path)]) == "ran"
  assert main(["--out-dir", str(tmp_path / "a" / "b")]) == "ran"  # made later
  (tmp_path / "f").write_text("")
  monkeypatch.chdir(tmp_path)
  assert cli_error(main, ["--out-dir", "f"], capsys) == "--out-dir f is a file, not a directory"
  assert cli_error(main, ["--out-dir", "f/a/b"], capsys) == (
      "--out-dir f/a/b cannot be made: f is a file, not a directory")
  assert list(tmp_path.iterdir()) == [tmp_path / "f"]


def test_a_directory_not_writable(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(os, "access", lambda path, mode: False)  # as a read-only one for a user
  main = _main(cli_checks.output_file, "--out-file")
  assert cli_error(main, ["--out-file", str(tmp_path / "a.json")], capsys) == (
      f"--out-file {tmp_path / 'a.json'}: the directory {tmp_path} is not writable")
  main = _main(cli_checks.output_dir, "--out-dir")
  assert cli_error(main, ["--out-dir", str(tmp_path / "new")], capsys) == (
      f"--out-dir {tmp_path / 'new'} cannot be written: the directory {tmp_path} is not "
      "writable")
