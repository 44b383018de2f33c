"""The `automap-rl` command: parses flags into typed configs and runs the launchers.

Only this package reads the command line; the library takes frozen dataclass configs.
Each command lives in its own module with `register(subparsers)`, which adds its parser
and sets `run(args)` as the parser's default `command`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

COMMAND_MODULES = ("inspect_cmd", "partition_cmd", "validate_cmd", "bench_cmd", "env_cmd")
# Commands that lower plans onto devices; the others run on one CPU device, as the
# simulator and the environments need no more (and 8 virtual devices' runtimes share the
# host's two cores: the throughput benchmarks drop by a third with them).
LOWERING_COMMANDS = frozenset({"partition", "validate"})


def virtual_devices(count: int = 8) -> None:
  """Gives jax `count` CPU devices unless the user set the flag; must run before jax imports."""
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()


def write_json(path: str | None, document: Any) -> None:
  """Writes a command's figures to `path` (every command's `--json`), if one was given."""
  if path:
    with open(path, "w") as f:
      json.dump(document, f, indent=1)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="automap-rl", description=__doc__.splitlines()[0])
  subparsers = parser.add_subparsers(dest="name", required=True)
  for name in COMMAND_MODULES:
    importlib.import_module(f"experiments.{name}").register(subparsers)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] and argv[0] in LOWERING_COMMANDS:
    virtual_devices()
  args = _parser().parse_args(argv)
  try:
    args.command(args)
  except ValueError as e:  # Bad input (a model spec, a mesh, a path): the message names it.
    print(f"automap-rl {args.name}: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
