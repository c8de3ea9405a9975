"""Every command-line entry point prints its help: argparse expands each option's help
with ``%``, so a bare ``%`` in one (``"10%"``) breaks ``--help`` for the whole command."""

import importlib
import pathlib
import subprocess
import sys

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


def test_every_command_package_is_installed(tmp_path):
  """The README's ``python -m benchmarks.llama_fit`` from a folder other than the repo's
  (the package was not installed: "No module named 'benchmarks'"); and every other package
  whose commands it gives."""
  code = ("import importlib.util, sys; "
          "sys.path = [p for p in sys.path if p not in ('', '.', sys.argv[1])]; "
          "print([p for p in sys.argv[2:] if importlib.util.find_spec(p) is None])")
  packages = sorted({m.split(".")[0] for m in COMMANDS})
  out = subprocess.run([sys.executable, "-c", code, str(ROOT), *packages], cwd=tmp_path,
                       capture_output=True, text=True, check=True).stdout
  assert out.strip() == "[]", (packages, out)
