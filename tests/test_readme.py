"""Every Python snippet in the README and the command reference runs as written, in a fresh
interpreter, and the command reference names every command and flag."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLI = ROOT / "docs" / "cli.md"


def _snippets(path: Path) -> list[str]:
  return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


SNIPPETS = _snippets(README) + _snippets(CLI)


def test_the_readme_has_snippets():
  assert len(_snippets(README)) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs_as_written(index, tmp_path):
  # The tests' environment: its XLA flags ask for the 8 devices the snippets set by default
  # and generate code without LLVM's expensive passes.
  result = subprocess.run(
    [sys.executable, "-c", SNIPPETS[index]],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]


def _flags(config_cls) -> list[str]:
  """The command-line flags of a config dataclass (nested configs by their prefix;
  positional arguments, which docs/cli.md names in capitals, left out)."""
  import dataclasses
  import typing

  hints = typing.get_type_hints(config_cls, include_extras=True)
  positional = lambda f: "Positional" in repr(hints[f.name])
  return [
    f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(config_cls) if not positional(f)
  ]


def test_every_command_and_flag_is_in_the_command_reference():
  import importlib

  from experiments import cli

  readme = CLI.read_text()
  missing = []
  for name, command in cli.COMMANDS.items():
    if f"automap-rl {name}" not in readme:
      missing.append(f"automap-rl {name}")
    config_cls = getattr(importlib.import_module(f"experiments.{command.module}"), command.config)
    missing += [f"{name} {flag}" for flag in _flags(config_cls) if flag not in readme]
  assert not missing, f"not documented in docs/cli.md: {missing}"
