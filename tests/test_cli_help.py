"""Every command-line entry point prints its help: argparse expands each option's help
with ``%``, so a bare ``%`` in one (``"10%"``) breaks ``--help`` for the whole command."""

import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _commands():
  """Modules of the packages that run as ``python -m`` and parse arguments."""
  for path in sorted(ROOT.glob("*/*.py")):
    if path.parts[-2] in ("lowmem_jax", "train", "models", "benchmarks"):
      text = path.read_text()
      if "argparse" in text and '__name__ == "__main__"' in text:
        yield f"{path.parts[-2]}.{path.stem}"


COMMANDS = tuple(_commands())


def test_the_commands_are_found():
  assert {"train.__main__", "train.bench", "lowmem_jax.gpu_check",
          "benchmarks.llama_fit"} <= set(COMMANDS), COMMANDS


@pytest.mark.parametrize("module", COMMANDS)
def test_help_prints_and_exits_zero(module, capsys):
  with pytest.raises(SystemExit) as exit_:
    importlib.import_module(module).main(["--help"])
  assert exit_.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: ") and "--help" in out, out[:200]
